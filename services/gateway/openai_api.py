"""The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Requests run on the same generation driver as the WebSocket; this module only translates. Defaults
follow vLLM (temperature 1.0; max_tokens ``limits.default_max_tokens`` capped by the context);
``top_k`` and ``repetition_penalty`` are accepted as vLLM's extensions. Errors use OpenAI's body
``{"error": {message, type, param, code}}`` with the HTTP status of the error type, so the official
client raises the matching exception class.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import INTERNAL_ERROR, MEMORY_PRESSURE, MODEL_LOADING_ERROR, RATE_LIMITED, TIMEOUT, TillerError
from services.gateway.driver import Generation, new_request_id
from services.gateway.engine import HEALTH_MAX_AGE_S
from services.gateway.httputil import SSE_HEADERS, client_of, gateway_of, read_json_object, sse, unless_disconnected
from services.gateway.protocol import CompletionMsg, ErrorMsg, InitMsg, LogprobEntry, ServerMsg, TokenMsg
from services.gateway.validation import (
    ChatMessage,
    Context,
    GenerationRequest,
    LimitChecks,
    MaxTokens,
    RepetitionPenalty,
    StopList,
    Temperature,
    TopK,
    TopP,
    validate,
)

router = APIRouter()

_ERROR_TYPES = {
    RATE_LIMITED: "rate_limit_error",
    INTERNAL_ERROR: "server_error",
    MEMORY_PRESSURE: "server_error",
    TIMEOUT: "server_error",
    MODEL_LOADING_ERROR: "server_error",
}
_FINISH_REASONS = {"cancelled": "abort"}  # the rest (stop, length, content_filter) are OpenAI's own


def _error_body(error: ErrorMsg) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": _ERROR_TYPES.get(error.code, "invalid_request_error"),
            "param": error.param,
            "code": error.code,
        }
    }


def error_response(error: ErrorMsg) -> JSONResponse:
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if error.retry_after_s is not None else None
    return JSONResponse(_error_body(error), status_code=error.http_status, headers=headers)


def _single_prompt(value: Any) -> str | list[int]:
    """OpenAI's prompt forms (text, token ids, or a batch of either) narrowed to one prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be empty")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise ValueError("only one prompt per request is supported")
    raise ValueError("must be a non-empty string or a non-empty list of token ids")


def _top_k(value: Any) -> Any:
    return 0 if value == -1 else value  # vLLM's (older) spelling of "disabled"


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _OpenAIRequest(LimitChecks):
    model_config = ConfigDict(strict=True, extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[TopK | None, BeforeValidator(_top_k)] = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopList | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension, for load tools built for vLLM
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only n=1 is supported (got {value}); send several requests instead")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("not supported; use repetition_penalty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("not supported")
        return value

    def _request(self, **kwargs: Any) -> GenerationRequest:
        return GenerationRequest(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            **kwargs,
        )


class CompletionRequest(_OpenAIRequest):
    prompt: Annotated[str | list[int], PlainValidator(_single_prompt)]
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only best_of=1 is supported (got {value})")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not supported")
        return value

    @model_validator(mode="after")
    def _no_prompt_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs would need prompt logprobs, which are not supported")
        return self

    def to_request(self) -> GenerationRequest:
        text = self.prompt if isinstance(self.prompt, str) else None
        ids = self.prompt if isinstance(self.prompt, list) else None
        return self._request(
            prompt=text, prompt_ids=ids, max_tokens=self.max_tokens, top_logprobs=self.logprobs, echo=self.echo
        )


class ChatCompletionRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def to_request(self) -> GenerationRequest:
        return self._request(
            messages=[m.model_dump() for m in self.messages],
            max_tokens=self.max_completion_tokens or self.max_tokens,
            top_logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


# -- response shapes ------------------------------------------------------------------------------


class _Format:
    """What differs between completions and chat completions: ids, object names, choice shapes."""

    id_prefix: str
    object: str
    chunk_object: str

    def __init__(self, logprobs: bool) -> None:
        self.logprobs = logprobs
        self.text_offset = 0  # completions' logprobs.text_offset of the next token

    def choice(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self, init: InitMsg, echo: bool) -> dict[str, Any] | None:
        """The choice of a first chunk sent before any token, if any."""
        return None


class _TextFormat(_Format):
    id_prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"

    def _logprobs(self, entries: list[list[LogprobEntry]]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for sampled, *alternatives in entries:
            out["tokens"].append(sampled.token)
            out["token_logprobs"].append(sampled.logprob)
            out["top_logprobs"].append({alt.token: alt.logprob for alt in alternatives})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(sampled.token)
        return out

    def choice(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(entries), "finish_reason": finish_reason}

    delta = choice

    def opening(self, init: InitMsg, echo: bool) -> dict[str, Any] | None:
        return self.choice(init.prompt_text, [], None) if echo else None


class _ChatFormat(_Format):
    id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def _entry(e: LogprobEntry) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode())}

    def _logprobs(self, entries: list[list[LogprobEntry]]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [{**self._entry(s), "top_logprobs": [self._entry(a) for a in alts]} for s, *alts in entries]}

    def choice(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": self._logprobs(entries), "finish_reason": finish_reason}

    def delta(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text or entries else {}
        return {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(entries) if entries else None,
            "finish_reason": finish_reason,
        }

    def opening(self, init: InitMsg, echo: bool) -> dict[str, Any] | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def _finish(reason: str) -> str:
    return _FINISH_REASONS.get(reason, reason)


async def _sse_chunks(
    fmt: _Format, gen: Generation, init: InitMsg, messages: AsyncIterator[ServerMsg], include_usage: bool
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": gen.rid,
            "object": fmt.chunk_object,
            "created": created,
            "model": init.model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    opening = fmt.opening(init, gen.request.echo)
    if opening is not None:
        yield chunk([opening])
    async for msg in messages:
        if isinstance(msg, TokenMsg):
            entries = [msg.logprobs] if msg.logprobs else []
            if msg.token or entries:
                yield chunk([fmt.delta(msg.token, entries, None)])
        elif isinstance(msg, CompletionMsg):
            yield chunk([fmt.delta("", [], _finish(msg.finish_reason))])
            if include_usage:
                yield chunk([], msg.usage.to_openai())
        elif isinstance(msg, ErrorMsg):
            yield sse(_error_body(msg))
    yield sse("[DONE]")


async def _collect(messages: AsyncIterator[ServerMsg]) -> tuple[CompletionMsg | ErrorMsg, list[list[LogprobEntry]]]:
    """The final message and every token's logprobs, reading the stream to its end."""
    final: CompletionMsg | ErrorMsg | None = None
    entries: list[list[LogprobEntry]] = []
    async for msg in messages:
        if isinstance(msg, TokenMsg) and msg.logprobs:
            entries.append(msg.logprobs)
        elif isinstance(msg, CompletionMsg | ErrorMsg):
            final = msg
    assert final is not None, "a generation stream always ends with a completion or an error"
    return final, entries


async def _serve(
    request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest], fmt_type: type[_Format]
) -> Response:
    gw = gateway_of(request)
    try:
        body = await read_json_object(request, gw.settings.limits.max_http_body_bytes)
        parsed = validate(model, body, Context.of(gw.settings))
    except TillerError as exc:
        return error_response(ErrorMsg.from_error(exc))
    if parsed.model is not None and parsed.model != gw.settings.served_model_name:
        message = f"The model `{parsed.model}` does not exist; this server serves `{gw.settings.served_model_name}`."
        return JSONResponse(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            },
            status_code=404,
        )
    req = parsed.to_request()
    gen = Generation(gw, req, rid=new_request_id(fmt_type.id_prefix), surface="openai", client=client_of(request))
    fmt = fmt_type(logprobs=req.top_logprobs is not None)
    messages = gen.stream()
    first = await anext(messages)
    if isinstance(first, ErrorMsg):
        await messages.aclose()
        return error_response(first)
    assert isinstance(first, InitMsg)
    if parsed.stream:
        include_usage = parsed.stream_options is not None and parsed.stream_options.include_usage
        return StreamingResponse(
            _sse_chunks(fmt, gen, first, messages, include_usage), media_type="text/event-stream", headers=SSE_HEADERS
        )
    collected = await unless_disconnected(request, _collect(messages))
    if collected is None:  # the client left; nobody reads this
        return Response(status_code=499)
    result, entries = collected
    if isinstance(result, ErrorMsg):
        return error_response(result)
    return JSONResponse(
        {
            "id": gen.rid,
            "object": fmt.object,
            "created": int(time.time()),
            "model": first.model,
            "choices": [fmt.choice(result.generated_text, entries, _finish(result.finish_reason))],
            "usage": result.usage.to_openai(),
        }
    )


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    try:  # the model's own context once a worker has reported it
        detail = (await gw.engine.health(max_age=HEALTH_MAX_AGE_S)).detail
    except TillerError:
        detail = {}
    max_model_len = detail.get("max_model_len") or gw.settings.limits.max_model_len
    return {
        "object": "list",
        "data": [
            {
                "id": gw.settings.served_model_name,
                "object": "model",
                "created": gw.created,
                "owned_by": "tiller",
                "max_model_len": max_model_len,
            }
        ],
    }


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest, _TextFormat)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatCompletionRequest, _ChatFormat)
