"""HTTP plumbing shared by the REST and OpenAI surfaces: bounded JSON bodies, SSE framing, client
addresses, JSON text as the streams send it, and abandoning a non-streaming generation when its client
disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse

from common.wire import Principal
from common.errors import ERROR_TRAITS, INTERNAL_ERROR, INVALID_REQUEST, TillerError
from services.gateway.deps import Gateway
from services.gateway.json_body import parse_json
from services.gateway.protocol import GatewayError
from services.gateway.side_channel import Unauthorized, caller_of
from services.gateway.store import NOT_FOUND
from services.gateway.tenants import Tenant, identify

T = TypeVar("T")
_json_encoder = msgspec.json.Encoder()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.5


def gateway_of(conn: HTTPConnection) -> Gateway:
    return conn.app.state.gateway


def client_of(conn: HTTPConnection) -> str:
    return conn.client.host if conn.client else "unknown"


def tenant_of(conn: HTTPConnection) -> Tenant:
    """Who the request is for (services.gateway.tenants)."""
    return identify(conn.headers, gateway_of(conn).settings)


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, read no further than ``limits.max_http_body_bytes`` and nested no
    deeper than ``limits.max_json_depth``."""
    limits = gateway_of(request).settings.limits
    limit = limits.max_http_body_bytes
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise GatewayError(INVALID_REQUEST, f"the request body exceeds {limit} bytes")
    data = parse_json(bytes(body), limits.max_json_depth, "the request body")
    if not isinstance(data, dict):
        raise GatewayError(INVALID_REQUEST, f"the request body must be a JSON object, not {type(data).__name__}")
    return data


def json_text(data: Any) -> str:
    """Compact JSON text, non-ASCII as is: what the streaming protocols send per token (msgspec's
    encoder, about ten times faster than ``json.dumps`` on a token message)."""
    return _json_encoder.encode(data).decode()


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json_text(data)
    return f"data: {payload}\n\n".encode()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each with its stream's index. Closing this (or a
    stream failing) cancels the readers: the cancellation lands in the streams they wait on."""
    end = object()  # a reader's last item: its stream is exhausted
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def read(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        finally:
            queue.put_nowait((i, end))

    readers = [asyncio.ensure_future(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        open_streams = len(readers)
        while open_streams:
            i, item = await queue.get()
            if item is end:
                open_streams -= 1
            else:
                yield i, item
        await asyncio.gather(*readers)  # a reader's failure is raised here
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; cancel it and return None if the client goes away first (Starlette cancels
    streaming responses on disconnect, but not plain handlers)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def error_json(exc: TillerError, status: int | None = None) -> JSONResponse:
    """The error of the AICI REST and steering routes, ``{"error": {"type", "message"}}``: 401 for a caller no
    token names, 404 for what the store does not have, else the code's status (``status`` overrides)."""
    if status is None:
        status = (401 if isinstance(exc, Unauthorized) else 404 if exc.code == NOT_FOUND
                  else ERROR_TRAITS.get(exc.code, ERROR_TRAITS[INTERNAL_ERROR])[2])
    return JSONResponse({"error": {"type": exc.code, "message": exc.message}}, status_code=status)


async def answer(request: Request, handle: Callable[[Gateway, Principal], Awaitable[Any]]) -> JSONResponse:
    """What ``handle(gateway, caller)`` returns, as JSON; a TillerError (the caller's too) as :func:`error_json`."""
    gw = gateway_of(request)
    try:
        return JSONResponse(await handle(gw, caller_of(request, gw.settings)))
    except TillerError as exc:
        return error_json(exc)
