"""The HTTP socket of one of several gateway processes sharing a port (``distributed.gateways``).

uvicorn binds without ``SO_REUSEPORT``, so a second process on the port would fail; each gateway binds this
socket itself and hands it to uvicorn. The kernel then spreads new connections over the listening processes
(by a hash of the connection's addresses): a connection, and so a WebSocket or a stream, stays on one.
The socket is bound, not listening: uvicorn listens once the app has started, so a gateway that is still
loading (a restarted one) is not handed connections it would leave waiting.
"""

from __future__ import annotations

import socket


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other processes of the same user may bind too."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
