"""The gateway's gRPC server (Evergreen today), run by grpc.aio in uvicorn's event loop."""

from __future__ import annotations

import grpc
import structlog

from services.gateway.deps import Gateway
from services.gateway.evergreen import service as evergreen
from services.gateway.salience import service as salience

log = structlog.get_logger()

STOP_GRACE_S = 2.0


async def start_grpc(gw: Gateway) -> grpc.aio.Server:
    """Serve gRPC on ``http_host:grpc_port``; a port that cannot be bound stops the gateway with a
    clear error rather than leaving the gRPC surfaces silently missing."""
    settings = gw.settings
    size = settings.evergreen.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second gateway on the same port must fail, not share it
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
        ]
    )
    evergreen.add_to_server(server, gw)
    await salience.add_to_server(server, gw)
    address = f"{settings.http_host}:{settings.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        log.error("grpc.bind_failed", address=address, error=str(exc))
        raise RuntimeError(f"cannot serve gRPC on {address} (is the port in use? set TILLER_GRPC_PORT)") from exc
    await server.start()
    log.info("grpc.ready", address=address)
    return server


async def stop_grpc(server: grpc.aio.Server) -> None:
    await server.stop(STOP_GRACE_S)
