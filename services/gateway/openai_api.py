"""The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Requests run on the same generation driver as the WebSocket; this module only translates. Defaults
follow vLLM (temperature 1.0; max_tokens 16 for completions, ``limits.completions_default_max_tokens``), but
chat completions' max_tokens defaults to ``limits.chat_default_max_tokens`` (unset: ``limits.default_max_tokens``)
rather than vLLM's room left in the context, as the scheduler reserves a request's whole KV at admission.
``top_k`` and ``repetition_penalty`` are accepted as vLLM's extensions. Errors use OpenAI's body
``{"error": {message, type, param, code}}`` with the HTTP status of the error type, so the official
client raises the matching exception class.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import (
    INTERNAL_ERROR,
    MEMORY_PRESSURE,
    MODEL_LOADING_ERROR,
    RATE_LIMITED,
    SERVICE_UNAVAILABLE,
    TIMEOUT,
    TillerError,
)
from services.gateway.deps import new_request_id
from services.gateway.driver import Generation
from services.gateway.scheduler_client import HEALTH_MAX_AGE_S, facts_of
from services.gateway.httputil import (
    SSE_HEADERS,
    client_of,
    gateway_of,
    tenant_of,
    merge,
    read_json_object,
    sse,
    unless_disconnected,
)
from services.gateway.protocol import CompletionMsg, ErrorMsg, InitMsg, LogprobEntry, ServerMsg, TokenMsg, Usage
from services.gateway.side_channel import format_caller
from services.gateway.chat_tools import ChatTools
from services.gateway.tool_calls import ReplyParser, ToolPlan, parse_reply
from services.gateway.validation import (
    ChatRendering,
    Context,
    GenerationRequest,
    INT64_MAX,
    CacheSalt,
    Int64,
    LimitChecks,
    MaxTokens,
    NullIsLeftOut,
    RepetitionPenalty,
    SteeringSpec,
    StopList,
    Temperature,
    TopK,
    TopP,
    context_of,
    validate,
    wrap_int64,
)

router = APIRouter()

_ERROR_TYPES = {
    RATE_LIMITED: "rate_limit_error",
    INTERNAL_ERROR: "server_error",
    MEMORY_PRESSURE: "server_error",
    TIMEOUT: "server_error",
    MODEL_LOADING_ERROR: "server_error",
    SERVICE_UNAVAILABLE: "server_error",
}
_FINISH_REASONS = {"cancelled": "abort"}  # the rest (stop, length, content_filter) are OpenAI's own


def error_body(error: ErrorMsg) -> dict[str, Any]:
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
    return JSONResponse(error_body(error), status_code=error.http_status, headers=headers)


def prompt_forms(noun: str) -> Callable[[Any], list[str | list[int]]]:
    """A validator of OpenAI's prompt forms (a completion's ``prompt``, an embedding's ``input``): one text,
    one list of token ids, or a batch (a list) of either; a refusal names the ``noun`` at fault."""

    def prompts(value: Any) -> list[str | list[int]]:
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token_id(t) for t in value)):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty string, a non-empty list of token ids, or a list of those")
        for i, prompt in enumerate(value):
            if isinstance(prompt, str) and prompt:
                continue
            if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
                continue
            where = f"{noun} {i}" if len(value) > 1 else f"the {noun}"
            raise ValueError(f"{where} must be a non-empty string or a non-empty list of token ids")
        return value

    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _top_k(value: Any) -> Any:
    return 0 if value == -1 else value  # vLLM's (older) spelling of "disabled"


def _only(*neutral: Any, hint: str = "") -> Any:
    """The type of a request field (OpenAI's or vLLM's) this server does not implement: the values
    that leave the output as it is without the field pass; any other is refused, not silently ignored."""

    def check(value: Any) -> Any:
        if value not in neutral:
            raise ValueError("not supported by this server" + (f"; {hint}" if hint else ""))
        return value

    return Annotated[Any, AfterValidator(check)]


class StreamOptions(NullIsLeftOut):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)  # description, strict

    name: str
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {}: any JSON value


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' goes with type 'json_schema' (and only with it)")
        return self

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow; None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}
        return None if self.json_schema is None else self.json_schema.json_schema


def _choice_regex(choices: list[str]) -> str:
    """A regex (llguidance's syntax, Rust's) matching exactly one of ``choices``: each character but letters,
    digits and spaces written as a ``\\x{...}`` escape, so none is read as a regex operator."""
    def literal(text: str) -> str:
        return "".join(c if c.isalnum() or c == " " else f"\\x{{{ord(c):x}}}" for c in text)

    return "(" + "|".join(literal(c) for c in choices) + ")"


Choices = Annotated[list[str], Field(min_length=1)]
JsonSchema = dict[str, Any] | Annotated[str, Field(min_length=1)]  # an object, or its JSON text (as vLLM takes it)


def _constraint_of(json_schema: JsonSchema | None, regex: str | None,
                   choice: list[str] | None) -> dict[str, Any] | None:
    """The JSON controller's constraint for the one of a schema, a regex or a choice of strings that is given."""
    if json_schema is not None:
        return {"json_schema": json_schema}
    if regex is not None:
        return {"regex": regex}
    if choice is not None:
        return {"regex": _choice_regex(choice)}
    return None


class StructuredOutputs(NullIsLeftOut):
    """vLLM's ``structured_outputs``: exactly one constraint of ``json`` (a JSON schema), ``regex``, ``choice`` or
    ``json_object``, run under the JSON controller as a ``response_format`` is."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    json_schema: JsonSchema | None = Field(None, alias="json")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Choices | None = None
    json_object: bool | None = None
    grammar: _only(None, hint="give a regex, a choice or a JSON schema") = None  # xgrammar's EBNF, not llguidance's
    structural_tag: _only(None) = None
    whitespace_pattern: _only(None) = None
    disable_any_whitespace: bool | None = None  # the output's JSON is compact: no whitespace either way
    disable_fallback: bool | None = None  # a backend choice: there is one backend
    disable_additional_properties: _only(None, False) = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [name for name, value in (("json", self.json_schema), ("regex", self.regex), ("choice", self.choice),
                                          ("json_object", self.json_object or None)) if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of 'json', 'regex', 'choice' or 'json_object' (got {given or 'none'})")
        return self

    def constraint(self) -> dict[str, Any]:
        return _constraint_of(self.json_schema, self.regex, self.choice) or {"json_schema": {"type": "object"}}


class _OpenAIRequest(NullIsLeftOut, LimitChecks):
    # OpenAI clients send fields that change nothing here (user, metadata, ...): those are ignored; a field sent
    # as null takes its default (vLLM's `n`, `stream`, `echo`, `logprobs`, ... are Optional: clients send null)
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[TopK | None, BeforeValidator(_top_k)] = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopList | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None  # vLLM's
    seed: Int64 | None = None
    ignore_eos: bool = False  # vLLM's extension, for load tools built for vLLM
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ends a choice stays in its text
    skip_special_tokens: bool = True  # vLLM's: False shows special tokens' text (<|im_end|>, ...)
    priority: Int64 = 0  # vLLM's: lower runs first (the scheduler's queue and batch order)
    cache_salt: CacheSalt | None = None  # vLLM's: KV shared only with requests of the same domain and salt
    steering: SteeringSpec | None = None  # Tiller's activation steering, beside the standard fields (docs/steering.md)
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # what OpenAI or vLLM would apply and this server cannot: refused unless neutral
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None  # vLLM's
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None  # vLLM's
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (as text) -> bias
    bad_words: _only(None, []) = None
    allowed_token_ids: _only(None) = None
    spaces_between_special_tokens: _only(None, True) = None
    use_beam_search: _only(None, False) = None
    length_penalty: _only(None, 1) = None
    prompt_logprobs: _only(None) = None
    truncate_prompt_tokens: _only(None) = None
    # constrained output (vLLM's; the guided_* fields are those of vLLM before 0.12, which now ignores them)
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Annotated[str, Field(min_length=1)] | None = None
    guided_choice: Choices | None = None
    guided_grammar: _only(None, hint="give guided_regex, guided_choice or guided_json") = None
    guided_whitespace_pattern: _only(None) = None
    guided_decoding_backend: str | None = None  # which library enforces the constraint: there is one

    @field_validator("stream_options")
    @classmethod
    def _options_of_a_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true (as vLLM)")
        return value

    @field_validator("response_format")
    @classmethod
    def _json_output_available(cls, value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        if value is not None and value.output_schema() is not None and context_of(info).json_controller is None:
            raise ValueError(f"type {value.type!r}: JSON output is not enabled on this server")
        return value

    @model_validator(mode="after")
    def _one_output_constraint(self) -> _OpenAIRequest:
        given = [name for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
                 if getattr(self, name) is not None]
        if self._output_schema() is not None:
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(given)}")
        return self

    @field_validator("structured_outputs", "guided_json", "guided_regex", "guided_choice")
    @classmethod
    def _constraints_available(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and context_of(info).json_controller is None:
            raise ValueError("constrained output is not enabled on this server")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()) or int(key) > INT64_MAX:
                raise ValueError(f"keys must be token ids, got {key!r}")
        return value

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> _OpenAIRequest:
        limit = getattr(self, "max_completion_tokens", None) or self.max_tokens
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({limit})")
        if self.min_tokens and self._output_constraint() is not None:
            raise ValueError("min_tokens cannot hold back the end of a constrained output (response_format, "
                             "structured_outputs, guided_*)")
        return self

    @property
    def tool_plan(self) -> ToolPlan | None:
        """The tool calls the model may make (chat completions only)."""
        return None

    def _output_schema(self) -> dict[str, Any] | None:
        return None if self.response_format is None else self.response_format.output_schema()

    def _output_constraint(self) -> dict[str, Any] | None:
        """The constraint a JSON ``response_format``, ``structured_outputs`` or a ``guided_*`` field puts on the
        output (at most one of them is given)."""
        schema = self._output_schema()
        if schema is not None:
            return {"json_schema": schema}
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return _constraint_of(self.guided_json, self.guided_regex, self.guided_choice)

    def _constraint(self) -> dict[str, Any] | None:
        """The JSON controller's constraint on the output, if the output has one."""
        return self._output_constraint()

    def _requests(self, context: Context, prompts: list[dict[str, Any]], **kwargs: Any) -> list[GenerationRequest]:
        """One request per choice: each prompt ``n`` times, choice ``i`` of a prompt seeded ``seed + i``
        (as vLLM seeds parallel samples), so the choices differ and a seed still fixes them all. A JSON
        ``response_format`` or tool calls run under the JSON controller, whose own token limit never
        cuts first; calls in a row stop before one that would not fit in the request's max_tokens."""
        constraint = self._constraint()
        if constraint is not None and self.tool_plan is not None and self.tool_plan.several:
            # calls in a row end where the next would not fit (the controller's budget)
            budget = kwargs["max_tokens"] or kwargs["default_max_tokens"] or context.limits.default_max_tokens
            constraint["budget"] = budget
        if constraint is not None:
            kwargs["controller"] = context.json_controller
            kwargs["controller_arg"] = json.dumps({**constraint, "max_tokens": context.limits.max_tokens_cap})
        return [
            GenerationRequest(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                min_tokens=self.min_tokens or 0,
                seed=None if self.seed is None else wrap_int64(self.seed + i),
                stop=tuple(self.stop or ()),
                include_stop_str=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                priority=self.priority,
                cache_salt=self.cache_salt,
                steering=self.steering,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                **prompt,
                **kwargs,
            )
            for prompt in prompts
            for i in range(self.n)
        ]


class CompletionRequest(_OpenAIRequest):
    prompt: Annotated[list[str | list[int]], PlainValidator(prompt_forms("prompt"))]
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 with echo: score the prompt only (as vLLM)
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: _only(None, 1, hint="use n") = None
    suffix: _only(None, "") = None

    @model_validator(mode="after")
    def _checks(self, info: ValidationInfo) -> CompletionRequest:
        cap = context_of(info).limits.max_choices
        if len(self.prompt) * self.n > cap:
            raise ValueError(f"{len(self.prompt)} prompts x n={self.n} make more than {cap} choices")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (it returns the prompt, scored with logprobs)")
        return self

    def to_requests(self, context: Context) -> list[GenerationRequest]:
        prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_ids": p} for p in self.prompt]
        return self._requests(context, prompts, max_tokens=self.max_tokens,
                              default_max_tokens=context.limits.completions_default_max_tokens,
                              top_logprobs=self.logprobs, echo=self.echo,
                              prompt_logprobs=self.echo and self.logprobs is not None)


class ChatCompletionRequest(ChatTools, _OpenAIRequest, ChatRendering):  # ChatTools first: its tool_plan wins
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    functions: _only(None, []) = None
    function_call: _only(None, "none", "auto") = None
    echo: _only(None, False) = None
    chat_template: _only(None) = None
    documents: _only(None, []) = None
    modalities: _only(None, ["text"]) = None
    audio: _only(None) = None
    prediction: _only(None) = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _calls_or_a_constraint(self) -> ChatCompletionRequest:
        guided = self._output_schema() is None and self._output_constraint() is not None
        if guided and self.tool_plan is not None:
            raise ValueError("structured_outputs and guided_* constrain the whole reply: not with tools the model "
                             "may call (tool_choice 'none' leaves them out; a JSON response_format constrains the "
                             "text answer)")
        return self

    def _constraint(self) -> dict[str, Any] | None:
        plan = self.tool_plan
        return super()._constraint() if plan is None else {"lark": plan.grammar(self._output_schema())}

    def to_requests(self, context: Context) -> list[GenerationRequest]:
        return self._requests(
            context,
            [{"messages": self.rendered_messages(), **self.rendering()}],
            max_tokens=self.max_completion_tokens or self.max_tokens,
            default_max_tokens=context.limits.chat_default_max_tokens,
            top_logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


# -- response shapes ------------------------------------------------------------------------------


class _Format:
    """What differs between completions and chat completions: ids, object names, choice shapes."""

    id_prefix: str
    object: str
    chunk_object: str

    def __init__(self, index: int, logprobs: bool, tools: ToolPlan | None = None) -> None:
        self.index = index  # the choice's index
        self.logprobs = logprobs
        self.tools = tools  # chat completions' tool calls, when the model may make them
        self.text_offset = 0  # completions' logprobs.text_offset of the next token

    def choice(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None,
               stop_reason: str | int | None = None) -> dict[str, Any]:
        """The whole choice; ``stop_reason`` as vLLM gives it (``CompletionMsg.stop_reason``)."""
        raise NotImplementedError

    def delta(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None,
              stop_reason: str | int | None = None) -> dict[str, Any] | None:
        """The choice of a chunk; None when there is nothing to send yet."""
        raise NotImplementedError

    def opening(self, init: InitMsg, echo: bool, prompt_entries: list[list[LogprobEntry]]) -> dict[str, Any] | None:
        """The choice of a first chunk sent before any token, if any (with ``echo``: the prompt,
        with its ``prompt_entries`` when logprobs are asked)."""
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
            # the token itself, then its `logprobs` most likely alternatives: up to logprobs + 1 entries, as vLLM
            # gives them; a prompt's first token has no logprob, nor alternatives (as vLLM and OpenAI's legacy API)
            top = {sampled.token: sampled.logprob, **{alt.token: alt.logprob for alt in alternatives}}
            out["top_logprobs"].append(None if sampled.logprob is None else top)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(sampled.token)
        return out

    def choice(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None,
               stop_reason: str | int | None = None) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": self._logprobs(entries), "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    delta = choice

    def opening(self, init: InitMsg, echo: bool, prompt_entries: list[list[LogprobEntry]]) -> dict[str, Any] | None:
        return self.choice(init.prompt_text, prompt_entries, None) if echo else None


class _ChatFormat(_Format):
    id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def _entry(e: LogprobEntry) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode())}

    def _logprobs(self, entries: list[list[LogprobEntry]]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [{**self._entry(s), "top_logprobs": [self._entry(a) for a in alts]} for s, *alts in entries]}

    def choice(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None,
               stop_reason: str | int | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tools is not None:
            reply, parser = parse_reply(self.tools, text)
            message["content"] = reply.content or None
            if reply.calls:
                message["tool_calls"] = [{k: v for k, v in c.to_openai().items() if k != "index"} for c in reply.calls]
            finish_reason = finish_reason and parser.finish_reason(finish_reason)
        return {
            "index": self.index,
            "message": message,
            "logprobs": self._logprobs(entries),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def __init__(self, index: int, logprobs: bool, tools: ToolPlan | None = None) -> None:
        super().__init__(index, logprobs, tools)
        self._parser = None if tools is None else ReplyParser(tools)

    def delta(self, text: str, entries: list[list[LogprobEntry]], finish_reason: str | None,
              stop_reason: str | int | None = None) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"content": text} if text or entries else {}
        if self._parser is not None:
            reply = self._parser.feed(text)
            if finish_reason is not None:
                reply.add(self._parser.close())
                finish_reason = self._parser.finish_reason(finish_reason)
            delta = {"content": reply.content} if reply.content else {}
            if reply.calls:
                delta["tool_calls"] = [c.to_openai() for c in reply.calls]
            if not delta and not entries and finish_reason is None:
                return None
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": self._logprobs(entries) if entries else None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def opening(self, init: InitMsg, echo: bool, prompt_entries: list[list[LogprobEntry]]) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None, "stop_reason": None}


def _finish(reason: str) -> str:
    return _FINISH_REASONS.get(reason, reason)


@dataclass
class Started:
    """A generation already past ``init``, and the rest of its messages."""

    gen: Generation
    init: InitMsg
    messages: AsyncIterator[ServerMsg]


@dataclass
class _Choice(Started):
    """One choice of a response: its generation, and how it is rendered."""

    fmt: _Format


def _total_usage(usages: list[Usage], n: int) -> dict[str, Any]:
    """The usage of a response as vLLM counts it: each prompt's tokens once (choices ``k*n`` to
    ``k*n + n - 1`` share prompt ``k``), every choice's completion tokens."""
    first_of_each_prompt = usages[::n]
    total = Usage(
        prompt_tokens=sum(u.prompt_tokens for u in first_of_each_prompt),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=sum(u.cached_tokens for u in first_of_each_prompt),
    )
    return total.to_openai()


async def _sse_chunks(
    rid: str, choices: list[_Choice], n: int, include_usage: bool, continuous_usage: bool = False
) -> AsyncIterator[bytes]:
    """The SSE stream of a response. With ``include_usage`` the chunks carry ``usage``: null but in the last
    chunk (no choices, the response's total); with ``continuous_usage`` too (vLLM's ``continuous_usage_stats``),
    every choice's chunk carries that choice's usage so far (its prompt, the tokens it generated up to then)."""
    created = int(time.time())
    fmt = choices[0].fmt
    generated = [0] * len(choices)  # each choice's tokens so far (a held-back token counts before its text shows)

    def usage_of(i: int, completion_tokens: int | None = None) -> dict[str, Any] | None:
        if not continuous_usage:
            return None
        done = generated[i] if completion_tokens is None else completion_tokens
        return Usage(choices[i].gen.usage.prompt_tokens, done).to_json()

    def chunk(parts: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": fmt.chunk_object,
            "created": created,
            "model": choices[0].init.model,
            "choices": parts,
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    def opening(i: int) -> bytes | None:
        choice = choices[i]
        part = choice.fmt.opening(choice.init, choice.gen.request.echo, choice.gen.prompt_entries)
        return None if part is None else chunk([part], usage_of(i))

    # a choice with prompt logprobs opens once they are in: they come before its first token
    unopened = {i for i, c in enumerate(choices) if c.gen.request.prompt_logprobs}
    for i in range(len(choices)):
        if i not in unopened and (data := opening(i)) is not None:
            yield data
    usages: dict[int, Usage] = {}
    async with contextlib.aclosing(merge([c.messages for c in choices])) as messages:
        async for i, msg in messages:
            choice_fmt = choices[i].fmt
            if i in unopened and isinstance(msg, TokenMsg | CompletionMsg):
                unopened.discard(i)
                if (data := opening(i)) is not None:
                    yield data
            if isinstance(msg, TokenMsg):
                generated[i] += 1
                entries = [msg.logprobs] if msg.logprobs else []
                if (msg.token or entries) and (part := choice_fmt.delta(msg.token, entries, None)) is not None:
                    yield chunk([part], usage_of(i))
            elif isinstance(msg, CompletionMsg):
                usages[i] = msg.usage
                finish = choice_fmt.delta("", [], _finish(msg.finish_reason), msg.stop_reason)
                yield chunk([finish], usage_of(i, msg.usage.completion_tokens))
            elif isinstance(msg, ErrorMsg):  # the response failed: the other choices end here too
                yield sse(error_body(msg))
                break
    if include_usage and len(usages) == len(choices):
        yield chunk([], _total_usage([usages[i] for i in range(len(choices))], n))
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


async def collect_all(
    choices: Sequence[Started], on_done: Callable[[int, int], None] | None = None,
) -> list[tuple[CompletionMsg, list[list[LogprobEntry]]]] | ErrorMsg:
    """Every generation's final message and logprobs, or the first error (which ends the others). ``on_done``
    hears each one that ends well: how many have, of how many."""
    tasks = [asyncio.ensure_future(_collect(c.messages)) for c in choices]
    try:
        for done, next_done in enumerate(asyncio.as_completed(tasks), 1):
            final, _ = await next_done
            if isinstance(final, ErrorMsg):
                return final
            if on_done is not None:
                on_done(done, len(tasks))
        return [t.result() for t in tasks]  # type: ignore[misc]  # no ErrorMsg left
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def finish_all(
    request: Request, started: Sequence[Started],
) -> list[tuple[CompletionMsg, list[list[LogprobEntry]]]] | Response:
    """:func:`collect_all` for a non-streamed answer, every generation closed after: its collection, or the
    response that ends the request (499 when the client left, the first error)."""
    try:
        collected = await unless_disconnected(request, collect_all(started))
    finally:
        await close_all(started)
    if collected is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if isinstance(collected, ErrorMsg):
        return error_response(collected)
    return collected


@dataclass
class Refused:
    """The refusal of request ``index`` of those :func:`start_all` was given."""

    index: int
    error: ErrorMsg


async def start_all(request: Request, requests: list[GenerationRequest], rid: str) -> list[Started] | Refused:
    """Start a generation per request, each up to its ``init``; the first refusal ends them all."""
    gw = gateway_of(request)
    caller = format_caller(request, gw.settings)
    tenant = tenant_of(request)
    started: list[Started] = []
    for i, req in enumerate(requests):
        rid_i = rid if len(requests) == 1 else f"{rid}-{i}"
        gen = Generation(gw, req, rid=rid_i, surface="openai", client=client_of(request), tenant=tenant,
                         caller=caller)
        messages = gen.stream()
        first = await anext(messages)
        if isinstance(first, ErrorMsg):
            await messages.aclose()
            await close_all(started)
            return Refused(i, first)
        assert isinstance(first, InitMsg)
        started.append(Started(gen, first, messages))
    return started


async def _start(
    request: Request, requests: list[GenerationRequest], fmt_type: type[_Format], rid: str, tools: ToolPlan | None
) -> list[_Choice] | ErrorMsg:
    """Start a generation per choice (see :func:`start_all`)."""
    started = await start_all(request, requests, rid)
    if isinstance(started, Refused):
        return started.error
    return [_Choice(s.gen, s.init, s.messages, fmt_type(i, logprobs=req.top_logprobs is not None, tools=tools))
            for i, (s, req) in enumerate(zip(started, requests, strict=True))]


async def close_all(choices: Sequence[Started]) -> None:
    """End the generations (those still running free their sequences)."""
    for choice in choices:
        await choice.messages.aclose()


async def _serve(
    request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest], fmt_type: type[_Format]
) -> Response:
    gw = gateway_of(request)
    context = Context.of(gw.settings)
    try:
        body = await read_json_object(request)
        parsed = validate(model, body, context)
    except TillerError as exc:
        gw.metrics.refused("openai", exc.code)
        return error_response(ErrorMsg.from_error(exc))
    if parsed.model is not None and parsed.model != gw.settings.served_model_name:
        gw.metrics.refused("openai", "model_not_found")
        return model_not_found(parsed.model, gw.settings.served_model_name)
    rid = new_request_id(fmt_type.id_prefix)
    choices = await _start(request, parsed.to_requests(context), fmt_type, rid, parsed.tool_plan)
    if isinstance(choices, ErrorMsg):
        return error_response(choices)
    if parsed.stream:
        options = parsed.stream_options or StreamOptions()
        include_usage = options.include_usage
        continuous = include_usage and options.continuous_usage_stats  # as vLLM: only with include_usage
        return StreamingResponse(
            _sse_chunks(rid, choices, parsed.n, include_usage, continuous),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    collected = await finish_all(request, choices)
    if isinstance(collected, Response):
        return collected
    return JSONResponse(
        {
            "id": rid,
            "object": choices[0].fmt.object,
            "created": int(time.time()),
            "model": choices[0].init.model,
            "choices": [
                c.fmt.choice(final.generated_text, c.gen.prompt_entries + entries, _finish(final.finish_reason),
                             final.stop_reason)
                for c, (final, entries) in zip(choices, collected, strict=True)
            ],
            "usage": _total_usage([final.usage for final, _ in collected], parsed.n),
        }
    )


async def max_model_len(request: Request) -> int:
    """The model's own context once a worker has reported it, else the configured one."""
    gw = gateway_of(request)
    try:
        known = facts_of(await gw.scheduler.health(max_age=HEALTH_MAX_AGE_S)).max_model_len
    except TillerError:
        known = 0
    return known or gw.settings.limits.max_model_len


async def _model_card(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    return {
        "id": gw.settings.served_model_name,
        "object": "model",
        "created": gw.created,
        "owned_by": "tiller",
        "max_model_len": await max_model_len(request),
    }


def model_not_found(model: str, served: str) -> JSONResponse:
    message = f"The model `{model}` does not exist; this server serves `{served}`."
    body = {"error": {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    return JSONResponse(body, status_code=404)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [await _model_card(request)]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> Response:
    """One model's card (the official client's ``models.retrieve``)."""
    served = gateway_of(request).settings.served_model_name
    if model != served:
        return model_not_found(model, served)
    return JSONResponse(await _model_card(request))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest, _TextFormat)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatCompletionRequest, _ChatFormat)
