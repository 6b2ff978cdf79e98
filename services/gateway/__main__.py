"""``python -m services.gateway``: the HTTP/WebSocket gateway under uvicorn."""

from __future__ import annotations

import uvicorn

from common.config import get_settings
from common.logging import configure_logging
from services.gateway.app import create_app


def main() -> None:
    settings = get_settings()
    configure_logging("gateway", settings.log_level)
    uvicorn.run(
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


if __name__ == "__main__":
    main()
