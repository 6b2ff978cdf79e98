"""Tiller gateway service."""
