"""The OpenAI Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``, ``GET /v1/responses/{id}/input_items``.

A response is a chat completion underneath (``responses_format.py`` translates): the same validation, prompt,
constraint and start (``openai_api.start_all``). With ``store`` (the default, as OpenAI's) the response, its
input items and the conversation it ends are kept in the session store (durable, ``sessions.responses_ttl_s``), as its creator's:
``previous_response_id`` continues that conversation, and two responses continuing one parent fork the chain.
Each stored response is a turn as a Salience session's is (``Submit.session``): the scheduler parks its KV under
the response id, and a continuation forks the previous turn's parked sequence (copy-on-write), so it prefills
only what follows the tokens they share. Another user is told a response does not exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common import wire
from common.errors import INTERNAL_ERROR, INVALID_REQUEST, TillerError
from common.tenancy import may_access
from services.gateway.deps import Gateway
from services.gateway.httputil import (
    SSE_HEADERS,
    gateway_of,
    json_text,
    read_json_object,
    tenant_of,
    unless_disconnected,
)
from services.gateway.openai_api import Refused, error_response, model_not_found, start_all
from services.gateway.protocol import CompletionMsg, ErrorMsg, GatewayError, TokenMsg
from services.gateway.responses_format import OutputBuilder, ResponsesRequest, ending, new_id, usage_of
from services.gateway.store import NOT_FOUND, StoreError
from services.gateway.validation import Context, validate

router = APIRouter()


def _not_found(response_id: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": f"No response found with id '{response_id}'.", "type": "invalid_request_error",
                      "param": param, "code": "not_found"}}
    return JSONResponse(body, status_code=404)


class _Missing(Exception):
    """The response does not exist for this caller (unknown, expired, deleted, or another user's)."""


def _caller(request: Request) -> wire.Principal:
    """Who the call is for, as on every surface (a stored response is its creator's; an admin may reach all)."""
    return tenant_of(request).principal


async def _owned(request: Request, response_id: str) -> wire.ResponseRecord:
    """The caller's stored response; :class:`_Missing` when there is none for them."""
    try:
        record = await gateway_of(request).store.get_response(response_id)
    except StoreError as exc:
        if exc.code == NOT_FOUND:
            raise _Missing from None
        raise
    if not may_access(record.owner, _caller(request)):
        raise _Missing
    return record


class _Turn:
    """One response being made: its request, its output so far, and the response object that shows it."""

    def __init__(self, parsed: ResponsesRequest, rid: str, model: str, conversation: list[dict[str, Any]],
                 output: OutputBuilder) -> None:
        self.parsed = parsed
        self.rid = rid
        self.model = model
        self.created_at = int(time.time())
        self.conversation = conversation  # what came before this request's input
        self.input_items = parsed.input_items()
        self.output = output
        self.error: ErrorMsg | None = None  # why it failed, if it did

    def failed(self, error: ErrorMsg) -> dict[str, Any]:
        self.error = error
        return self.body("failed", error=error)

    def body(self, status: str, final: CompletionMsg | None = None, error: ErrorMsg | None = None) -> dict[str, Any]:
        reason = None if final is None else ending(final.finish_reason)[1]
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": None if reason is None else {"reason": reason},
            "model": self.model,
            "output": self.output.items if final is not None else [],
            "usage": None if final is None else usage_of(final.usage),
            **self.parsed.echo(),
        }

    def record(self, gw: Gateway, owner: str, body: dict[str, Any]) -> wire.ResponsePut:
        conversation = [*self.conversation, *self.input_items, *self.output.items]
        return wire.ResponsePut(response_id=self.rid, owner=owner, body=json_text(body),
                                input_items=json_text(self.input_items), conversation=json_text(conversation),
                                ttl_s=gw.settings.sessions.responses_ttl_s)


async def _events(request: Request, turn: _Turn, messages: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """The response's stream events, from ``response.created`` to ``response.completed`` (``incomplete``,
    ``failed``); the last one carries the whole response. A stored response is in the store before it."""
    out = turn.output
    yield out.event("response.created", response=turn.body("in_progress"))
    yield out.event("response.in_progress", response=turn.body("in_progress"))
    async with contextlib.aclosing(messages):
        async for msg in messages:
            if isinstance(msg, TokenMsg) and msg.token:
                for event in out.feed(msg.token):
                    yield event
            elif isinstance(msg, CompletionMsg):
                for event in out.close(msg.finish_reason):
                    yield event
                status = ending(msg.finish_reason)[0]
                body = turn.body(status, msg)
                if turn.parsed.store:
                    try:
                        await gateway_of(request).store.put_response(turn.record(gateway_of(request), _caller(request).user,
                                                                                 body))
                    except TillerError as exc:
                        error = ErrorMsg.from_error(TillerError(INTERNAL_ERROR, f"the response could not be stored: "
                                                                f"{exc.message}; retry, or send store: false"))
                        yield out.event("response.failed", response=turn.failed(error))
                        return
                kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status,
                                                                                                  "response.failed")
                yield out.event(kind, response=body)
                return
            elif isinstance(msg, ErrorMsg):
                yield out.event("response.failed", response=turn.failed(msg))
                return


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json_text(event)}\n\n".encode()


async def _stream(request: Request, turn: _Turn, messages: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    async for event in _events(request, turn, messages):
        yield _sse(event)


async def _last(events: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    async for event in events:
        last = event
    return last


async def _start(request: Request) -> tuple[_Turn, AsyncIterator[Any]] | Response:
    """Validate, translate and start the generation up to its ``init``; or the error response."""
    gw = gateway_of(request)
    context = Context.of(gw.settings)
    try:
        parsed = validate(ResponsesRequest, await read_json_object(request), context)
        if parsed.model is not None and parsed.model != gw.settings.served_model_name:
            return model_not_found(parsed.model, gw.settings.served_model_name)
        conversation: list[dict[str, Any]] = []
        if parsed.previous_response_id is not None:
            try:
                conversation = json.loads((await _owned(request, parsed.previous_response_id)).conversation)
            except _Missing:
                return _not_found(parsed.previous_response_id, "previous_response_id")
        chat = parsed.chat_request(conversation, context)
        (generation_request,) = chat.to_requests(context)
    except TillerError as exc:
        gw.metrics.refused("openai", exc.code)
        return error_response(ErrorMsg.from_error(exc))
    rid = new_id("resp")
    if parsed.store:  # its KV is parked for a continuation, which forks the previous turn's
        generation_request = dataclasses.replace(generation_request, park_as=rid,
                                                 continues=parsed.previous_response_id or "")
    started = await start_all(request, [generation_request], rid)
    if isinstance(started, Refused):
        return error_response(started.error)
    (first,) = started
    return _Turn(parsed, rid, first.init.model, conversation, OutputBuilder(chat.tool_plan)), first.messages


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    started = await _start(request)
    if isinstance(started, Response):
        return started
    turn, messages = started
    if turn.parsed.stream:
        return StreamingResponse(_stream(request, turn, messages), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        last = await unless_disconnected(request, _last(_events(request, turn, messages)))
    finally:
        await messages.aclose()
    if last is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if turn.error is not None:  # unstreamed, a failure is an error (its own status: a timeout is a 504)
        return error_response(turn.error)
    return JSONResponse(last["response"])


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    try:
        record = await _owned(request, response_id)
    except _Missing:
        return _not_found(response_id)
    return Response(record.body, media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    try:
        await _owned(request, response_id)
        await gateway_of(request).store.delete_response(response_id)
    except (_Missing, StoreError) as exc:
        if isinstance(exc, StoreError) and exc.code != NOT_FOUND:
            raise
        return _not_found(response_id)
    with contextlib.suppress(TillerError):  # best effort: parked KV is a cache, evicted when room is needed
        await gateway_of(request).scheduler.drop_session(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    """Only a background response can be cancelled (as OpenAI says); this server runs none."""
    try:
        await _owned(request, response_id)
    except _Missing:
        return _not_found(response_id)
    error = GatewayError(INVALID_REQUEST, "only a background response can be cancelled, and this server runs none "
                         "(background is not supported); this response has finished")
    return error_response(ErrorMsg.from_error(error))


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(request: Request, response_id: str, limit: int = 20, order: Literal["asc", "desc"] = "desc",
                      after: str | None = None) -> Response:
    """The response's own input items (OpenAI's list: newest first unless ``order=asc``, ``limit`` 1..100, from
    after the item ``after``)."""
    if not 1 <= limit <= 100:
        error = GatewayError(INVALID_REQUEST, f"limit: must be from 1 to 100 (got {limit})", param="limit")
        return error_response(ErrorMsg.from_error(error))
    try:
        record = await _owned(request, response_id)
    except _Missing:
        return _not_found(response_id)
    items = json.loads(record.input_items)
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    if after is not None:
        if after not in ids:
            error = GatewayError(INVALID_REQUEST, f"after: no input item {after!r} in this response", param="after")
            return error_response(ErrorMsg.from_error(error))
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
