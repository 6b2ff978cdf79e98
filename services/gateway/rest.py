"""``POST /v1/generate``: the WebSocket protocol's REST twin (the protocol's "Compatibility with REST APIs").

The body is a config (``prompt`` or ``messages``, ``model``) with the parameters and options flat
at the top level or nested as on the WebSocket. Without ``stream`` (or with ``stream: false``) the
answer is the completion as JSON, as REST APIs do (the WebSocket's own default is to stream); with
``stream: true``, the WebSocket's messages as server-sent events. Errors are
``{"error": {type, message, recoverable, recovery_action, ...}}`` with the error type's HTTP status.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import ERROR_TRAITS, INTERNAL_ERROR, TillerError
from services.gateway.deps import new_request_id
from services.gateway.driver import Generation, protocol_messages
from services.gateway.httputil import (
    SSE_HEADERS,
    client_of,
    gateway_of,
    tenant_of,
    prepend,
    read_json_object,
    sse,
    unless_disconnected,
)
from services.gateway.protocol import ErrorMsg
from services.gateway.side_channel import caller_of
from services.gateway.validation import Context, GenerateConfig, flat_body_to_config, validate

router = APIRouter()


def error_response(error: dict[str, Any]) -> JSONResponse:
    """A protocol ``error`` message as the REST error body and status."""
    fields = {k: v for k, v in error.items() if k not in ("type", "error")}
    status = ERROR_TRAITS.get(error["error"], ERROR_TRAITS[INTERNAL_ERROR])[2]
    retry_after = error.get("retry_after")
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after is not None else None
    return JSONResponse({"error": {"type": error["error"], **fields}}, status_code=status, headers=headers)


def rest_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A config without ``stream`` does not stream over REST (a malformed ``options`` is validation's)."""
    options = config.get("options", {})
    if isinstance(options, dict) and "stream" not in options:
        config["options"] = {**options, "stream": False}
    return config


async def _last(messages: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    async for message in messages:
        last = message
    return last


async def _events(messages: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for message in messages:
        yield sse(message)


@router.post("/v1/generate")
async def generate(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        body = await read_json_object(request)
        config = validate(GenerateConfig, rest_defaults(flat_body_to_config(body)), Context.of(gw.settings))
        caller = caller_of(request, gw.settings) if config.controller else None
    except TillerError as exc:
        gw.metrics.refused("rest", exc.code)
        return error_response(ErrorMsg.from_error(exc).to_json())
    gen = Generation(
        gw, config.to_request(), rid=new_request_id("gen_"), surface="rest", client=client_of(request),
        tenant=tenant_of(request), caller=caller,
    )
    messages = protocol_messages(gen, config.options)
    first = await anext(messages)
    if first["type"] == "error":
        await messages.aclose()
        return error_response(first)
    if config.options.stream:
        return StreamingResponse(_events(prepend(first, messages)), media_type="text/event-stream", headers=SSE_HEADERS)
    last = await unless_disconnected(request, _last(messages))
    if last is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if last["type"] == "error":
        return error_response(last)
    result = {k: v for k, v in last.items() if k not in ("type", "request_id")}
    return JSONResponse({"id": gen.rid, "model": gw.settings.served_model_name, **result})
