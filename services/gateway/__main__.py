"""``python -m services.gateway``: the HTTP/WebSocket gateway under uvicorn."""

from __future__ import annotations

import sys

import uvicorn
from uvicorn.main import STARTUP_FAILURE

from common.config import get_settings
from common.logging import configure_logging
from services.gateway.app import create_app
from services.gateway.listen import shared_socket


def main() -> None:
    settings = get_settings()
    configure_logging("gateway", settings.log_level)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.http_host,
        port=settings.http_port,
        ws_max_size=settings.limits.max_ws_message_bytes,
        log_config=None,
        access_log=False,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        ssl_certfile=settings.tls.certfile,  # TLS (settings.tls): HTTPS and WSS on the same port
        ssl_keyfile=settings.tls.keyfile,
    )
    # one of several gateways on the port (SO_REUSEPORT); alone, uvicorn binds it (a second one must fail)
    shared = [shared_socket(settings.http_host, settings.http_port)] if settings.distributed.gateways > 1 else None
    server = uvicorn.Server(config)
    server.run(sockets=shared)
    if not server.started:  # as uvicorn.run: a failed start (a port in use, a broken lifespan) exits non-zero
        sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
