"""``POST /v1/steering/vectors:build``: a steering vector built in the server from contrastive examples (CAA).

Each text of each pair runs as a prefill-only request through the one generation pipeline (admission, tenant,
cache domain), asking for the residual stream after the chosen layers at its last token; the differences are
reduced by :mod:`services.gateway.vector_build` and the vector is stored as an upload is
(``services.gateway.steering``). A text is a string (the prompt as it is) or chat messages: rendered with the
model's chat template, ending on the last message's own last token when it is the assistant's
(``continue_final_message``), else on the generation prompt. With ``"stream": true`` the answer is a stream of
server-sent events: progress (``{"object": "steering.build.progress", "done", "total"}``, in texts) and then the
stored vector's answer, or an error (OpenAI's ``{"error": ...}``).
Errors take OpenAI's shape.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import Field, ValidationInfo, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import INTERNAL_ERROR, INVALID_REQUEST, TillerError
from common.steering import SteeringError
from services.gateway.deps import new_request_id
from services.gateway.httputil import SSE_HEADERS, gateway_of, read_json_object, sse, tenant_of
from services.gateway.openai_api import (Refused, Started, close_all, collect_all, error_body, error_response,
                                         start_all)
from services.gateway.protocol import ErrorMsg, GatewayError
from services.gateway.steering import check_fits, model_facts, model_shape, store_vector
from services.gateway.validation import ChatMessage, Context, GenerationRequest, StrictModel, context_of, validate
from services.gateway.vector_build import Method, contrastive_vector, residual_rows

router = APIRouter()

BuildText = Annotated[str, Field(min_length=1)] | Annotated[list[ChatMessage], Field(min_length=1)]


class BuildPair(StrictModel):
    positive: BuildText
    negative: BuildText


class BuildRequest(StrictModel):
    pairs: Annotated[list[BuildPair], Field(min_length=1)]
    layers: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    method: Method = "mean"
    tags: list[str] = []
    stream: bool = False

    @field_validator("pairs")
    @classmethod
    def _pair_count(cls, value: list[BuildPair], info: ValidationInfo) -> list[BuildPair]:
        cap = context_of(info).steering.max_build_pairs
        if len(value) > cap:
            raise ValueError(f"at most {cap} pairs are allowed (got {len(value)})")
        return value

    @field_validator("layers")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("each layer at most once")
        return sorted(value)

    def texts(self) -> list[BuildText]:
        """Positives and negatives, pair by pair: text ``2i`` is pair i's positive, ``2i + 1`` its negative."""
        return [text for pair in self.pairs for text in (pair.positive, pair.negative)]

    def renderings(self) -> list[GenerationRequest]:
        """Each text as the gateway renders and tokenizes a prompt (:meth:`texts` order)."""
        requests = []
        for text in self.texts():
            if isinstance(text, str):
                requests.append(GenerationRequest(prompt=text))
            else:
                ends_open = text[-1].role == "assistant"
                requests.append(GenerationRequest(messages=[m.model_dump() for m in text],
                                                  add_generation_prompt=not ends_open, continue_final_message=ends_open))
        return requests

    def to_requests(self, prompts: list[list[int]]) -> list[GenerationRequest]:
        """The prefill-only requests of the texts' token ids, asking their last position's residual stream."""
        return [GenerationRequest(prompt_ids=ids, max_tokens=0, residual_layers=tuple(self.layers)) for ids in prompts]


@router.post("/v1/steering/vectors:build")
async def build(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        parsed = validate(BuildRequest, await read_json_object(request), Context.of(gw.settings))
        check_fits("the build", None, parsed.layers, model_shape(await model_facts(gw)), param="layers")
        requests = parsed.to_requests(await _prompts(gw, parsed, gw.settings.steering.max_build_tokens))
    except TillerError as exc:
        return error_response(ErrorMsg.from_error(exc))
    if not parsed.stream:
        result = await _run(request, parsed, requests, lambda done, total: None)
        if isinstance(result, ErrorMsg):
            return error_response(result)
        return JSONResponse(result)
    return StreamingResponse(_events(request, parsed, requests), media_type="text/event-stream", headers=SSE_HEADERS)


async def _prompts(gw: Any, parsed: BuildRequest, cap: int) -> list[list[int]]:
    """Each text's token ids, rendered once; each within ``steering.max_build_tokens`` (a refusal names the text)."""
    prompts = []
    for i, rendering in enumerate(parsed.renderings()):
        _, ids = await gw.text.prompt(rendering)
        if len(ids) > cap:
            side = "positive" if i % 2 == 0 else "negative"
            raise GatewayError(INVALID_REQUEST, f"pairs[{i // 2}].{side} is {len(ids)} tokens, more than the "
                               f"{cap} a build text may have (steering.max_build_tokens)", param="pairs")
        prompts.append(ids)
    return prompts


async def _events(request: Request, parsed: BuildRequest, requests: list[GenerationRequest]) -> AsyncIterator[bytes]:
    progress: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    task = asyncio.ensure_future(_run(request, parsed, requests,
                                      lambda done, total: progress.put_nowait((done, total))))
    try:
        while not task.done() or not progress.empty():
            getter = asyncio.ensure_future(progress.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                done, total = getter.result()
                yield sse({"object": "steering.build.progress", "done": done, "total": total})
            else:
                getter.cancel()
        result = task.result()
        yield sse(error_body(result) if isinstance(result, ErrorMsg) else result)
    finally:
        task.cancel()


async def _run(request: Request, parsed: BuildRequest, requests: list[GenerationRequest],
               on_done: Callable[[int, int], None]) -> dict[str, Any] | ErrorMsg:
    """Run the texts' ``requests``, build the vector, store it: its stored answer, or the first error."""
    gw = gateway_of(request)
    started = await start_all(request, requests, new_request_id("build-"))
    if isinstance(started, Refused):
        return started.error
    try:
        collected = await collect_all(started, on_done)
    finally:
        await close_all(started)
    if isinstance(collected, ErrorMsg):
        return collected
    try:
        vector = _vector(started, parsed)
        return await store_vector(gw, vector, tenant_of(request).principal, parsed.tags)
    except SteeringError as exc:
        return ErrorMsg.from_error(TillerError(INVALID_REQUEST, str(exc)))
    except TillerError as exc:
        return ErrorMsg.from_error(exc)


def _vector(started: list[Started], parsed: BuildRequest) -> Any:
    residuals = [s.gen.residual for s in started]
    if not all(residuals):
        raise TillerError(INTERNAL_ERROR, "the scheduler returned no residual stream for some texts")
    hidden = len(residuals[0]) // (4 * len(parsed.layers))
    rows = [residual_rows(r, len(parsed.layers), hidden) for r in residuals]
    return contrastive_vector(rows[0::2], rows[1::2], parsed.layers, parsed.method)
