"""The gateway's gRPC server (Evergreen and Salience), run by grpc.aio in uvicorn's event loop; every call passes
the auth of :mod:`services.gateway.auth` first."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from common.config import Tls
from services.gateway import auth
from services.gateway.deps import Gateway
from services.gateway.evergreen import service as evergreen
from services.gateway.grpc_requests import HANDLER_KINDS, text_metadata
from services.gateway.salience import service as salience

log = structlog.get_logger()

# how long a refused client stream may go on sending before its refusal (see _refusing)
REFUSED_STREAM_DRAIN_S = 0.5
# the gRPC service (the full name's package) -> the surface whose tokens open it
SURFACE_OF_SERVICE = {"evergreen": auth.EVERGREEN, "salience": auth.SALIENCE}


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC of every service: a call without an accepted token ends UNAUTHENTICATED before its handler runs."""

    def __init__(self, settings: Any) -> None:
        self._key_header = settings.api_auth.key_header
        self._tokens = {name: auth.accepted_tokens(settings, surface) for name, surface in SURFACE_OF_SERVICE.items()}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        package = details.method.lstrip("/").partition(".")[0]  # "/salience.v1.Salience/Generate" -> "salience"
        metadata = text_metadata(details.invocation_metadata)
        problem = auth.refusal(self._tokens.get(package, frozenset()),
                               auth.presented_token(metadata, self._key_header), self._key_header)
        if handler is None or problem is None:
            return handler
        return _refusing(handler, problem)


def _refusing(handler: grpc.RpcMethodHandler, problem: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that ends the call UNAUTHENTICATED without parsing its request.

    A client stream is read (as raw bytes, for at most ``REFUSED_STREAM_DRAIN_S``) until the client half-closes
    before the refusal: grpc's asyncio client reports ``INTERNAL`` instead of the server's status when one of its
    writes lands after the server ended the call (grpc/grpc#36066), so refusing at once would hide the reason."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        if handler.request_streaming:
            with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
                await asyncio.wait_for(_drain(request), REFUSED_STREAM_DRAIN_S)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

    kind = HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return kind(refuse, response_serializer=handler.response_serializer)


async def _drain(requests: AsyncIterator[bytes]) -> None:
    async for _ in requests:
        pass


async def start_grpc(gw: Gateway) -> grpc.aio.Server:
    """Serve gRPC on ``http_host:grpc_port``; a port that cannot be bound stops the gateway with a
    clear error rather than leaving the gRPC surfaces silently missing."""
    settings = gw.settings
    size = settings.evergreen.max_message_bytes
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(settings)],
        options=[
            # alone, a second server on the port must fail, not share it; one of several shares it
            ("grpc.so_reuseport", int(settings.distributed.gateways > 1)),
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
        ]
    )
    evergreen.add_to_server(server, gw)
    await salience.add_to_server(server, gw)
    address = f"{settings.http_host}:{settings.grpc_port}"
    try:
        if settings.tls.enabled:
            server.add_secure_port(address, _server_credentials(settings.tls))
        else:
            server.add_insecure_port(address)
    except RuntimeError as exc:
        log.error("grpc.bind_failed", address=address, error=str(exc))
        raise RuntimeError(f"cannot serve gRPC on {address} (is the port in use? set TILLER_GRPC_PORT)") from exc
    await server.start()
    log.info("grpc.ready", address=address, tls=settings.tls.enabled)
    return server


def _server_credentials(tls: Tls) -> grpc.ServerCredentials:
    """The certificate and key of settings.tls (the ones uvicorn serves HTTPS with)."""
    assert tls.certfile is not None and tls.keyfile is not None
    return grpc.ssl_server_credentials([(tls.keyfile.read_bytes(), tls.certfile.read_bytes())])


async def stop_grpc(server: grpc.aio.Server, grace_s: float) -> None:
    await server.stop(grace_s)
