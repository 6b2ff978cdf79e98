"""Tiller scheduler service."""
