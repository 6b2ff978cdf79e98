"""Tiller worker service."""
