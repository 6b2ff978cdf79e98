"""Tiller controller runtime service."""
