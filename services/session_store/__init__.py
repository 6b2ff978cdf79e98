"""Tiller session store service."""
