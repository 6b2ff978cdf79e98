"""OpenAI's ``POST /v1/embeddings`` on the served model.

Each input runs as a prefill-only request (``max_tokens`` 0) through the one generation pipeline, admission,
tenant and cache domain included, asking the scheduler for the prompt's pooled final hidden state
(``embeddings.pooling``, :mod:`common.pooling`) instead of tokens; its KV is freed after, never parked.
Errors take OpenAI's shape (``openai_api.error_response``).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import ConfigDict, Field, PlainValidator, ValidationInfo, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from common import pooling
from common.errors import INTERNAL_ERROR, INVALID_REQUEST, TillerError
from services.gateway.deps import new_request_id
from services.gateway.httputil import gateway_of, read_json_object
from services.gateway.openai_api import (Refused, Started, error_response, finish_all, model_not_found, prompt_forms,
                                         start_all)
from services.gateway.protocol import ErrorMsg, GatewayError
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, facts_of
from services.gateway.validation import (CacheSalt, Context, GenerationRequest, Int64, NullIsLeftOut, context_of,
                                         validate)

router = APIRouter()


class EmbeddingRequest(NullIsLeftOut):
    # as the other OpenAI requests: fields that change nothing here (user, ...) are ignored
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: Annotated[list[str | list[int]], PlainValidator(prompt_forms("input"))]
    encoding_format: pooling.EncodingFormat = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None  # only the model's own (checked once its size is known)
    priority: Int64 = 0  # vLLM's: lower runs first
    cache_salt: CacheSalt | None = None  # vLLM's: KV shared only with requests of the same domain and salt

    @field_validator("input")
    @classmethod
    def _input_count(cls, value: list[str | list[int]], info: ValidationInfo) -> list[str | list[int]]:
        cap = context_of(info).embeddings.max_inputs
        if len(value) > cap:
            raise ValueError(f"at most {cap} inputs are allowed (got {len(value)})")
        return value

    def to_requests(self, context: Context) -> list[GenerationRequest]:
        return [
            GenerationRequest(**({"prompt": p} if isinstance(p, str) else {"prompt_ids": p}), max_tokens=0,
                              pooling=context.embeddings.pooling, priority=self.priority, cache_salt=self.cache_salt)
            for p in self.input
        ]


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """``dimensions`` may only ask for the model's own size: nothing here shortens a vector (a model trained for
    it, Matryoshka style, would be needed)."""
    if dimensions is None or dimensions == hidden_size:
        return
    size = f"have the model's {hidden_size} dimensions" if hidden_size else "have the model's hidden size (not known yet)"
    raise GatewayError(INVALID_REQUEST, f"dimensions: not supported by this server: its embeddings {size} and are "
                       f"not shortened; leave dimensions out (got {dimensions})", param="dimensions")


def input_refusal(refused: Refused, inputs: int) -> ErrorMsg:
    """A refusal of one input as the client sees it: a prompt too long for the context names the input."""
    error = refused.error
    if error.param == "prompt":  # the driver's name for it (a token id outside the vocabulary, a prompt too long)
        where = f"input {refused.index}" if inputs > 1 else "input"
        error = dataclasses.replace(error, param="input", message=f"{where}: {error.message.removeprefix('prompt: ')}")
    return error


def _data(started: list[Started], encoding_format: pooling.EncodingFormat, normalize: bool) -> list[dict[str, Any]]:
    data = []
    for i, s in enumerate(started):
        vector = pooling.vector_of(s.gen.embedding)
        if not vector.size:
            raise TillerError(INTERNAL_ERROR, f"input {i}: the scheduler returned no embedding")
        vector = pooling.unit(vector) if normalize else vector
        data.append({"object": "embedding", "index": i, "embedding": pooling.encode(vector, encoding_format)})
    return data


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    gw = gateway_of(request)
    context = Context.of(gw.settings)
    try:
        parsed = validate(EmbeddingRequest, await read_json_object(request), context)
        if parsed.model is not None and parsed.model != gw.settings.served_model_name:
            gw.metrics.refused("openai", "model_not_found")
            return model_not_found(parsed.model, gw.settings.served_model_name)
        if parsed.dimensions is not None:
            check_dimensions(parsed.dimensions, facts_of(await gw.scheduler.health(max_age=HEALTH_MAX_AGE_S)).hidden_size)
    except TillerError as exc:
        gw.metrics.refused("openai", exc.code)
        return error_response(ErrorMsg.from_error(exc))
    started = await start_all(request, parsed.to_requests(context), new_request_id("embd-"))
    if isinstance(started, Refused):
        return error_response(input_refusal(started, len(parsed.input)))
    collected = await finish_all(request, started)
    if isinstance(collected, Response):
        return collected
    try:
        data = _data(started, parsed.encoding_format, gw.settings.embeddings.normalize)
    except TillerError as exc:
        return error_response(ErrorMsg.from_error(exc))
    tokens = sum(s.gen.usage.prompt_tokens for s in started)
    return JSONResponse({
        "object": "list",
        "data": data,
        "model": started[0].init.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })
