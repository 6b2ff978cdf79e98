"""Shared code of every Tiller service: wire schemas, sockets, settings, logging, errors."""
