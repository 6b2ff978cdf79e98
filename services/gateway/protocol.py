"""The server messages of the WebSocket protocol, as typed values.

The generation driver yields these; the WebSocket and REST/SSE surfaces render them with
:meth:`to_json` (which applies the client's ``options``), the OpenAI surface reads their fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from common import wire
from common.errors import ERROR_TRAITS, INTERNAL_ERROR, TillerError


@dataclass
class GatewayError(TillerError):
    """A :class:`TillerError` with what a surface reports beyond the code."""

    param: str | None = None  # the offending request field, when one is to blame
    retry_after_s: float | None = None  # rate limiting: when a retry can succeed


class OutputOptions(Protocol):
    """The ``options`` of a config that shape the messages (see ``validation.Options``)."""

    stream: bool
    include_token_ids: bool
    include_logprobs: int | None
    include_timing: bool


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    token_id: int
    logprob: float | None  # None only for a prompt's first token (nothing comes before it)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache or a session

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's usage object, with ``prompt_tokens_details.cached_tokens`` as vLLM reports it."""
        return {**self.to_json(), "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class InitMsg:
    request_id: str
    model: str
    model_info: dict[str, Any]
    prompt_text: str  # the rendered prompt (OpenAI echo); not part of the message

    def to_json(self, options: OutputOptions) -> dict[str, Any]:
        return {"type": "init", "request_id": self.request_id, "model": self.model, "model_info": self.model_info}


@dataclass(frozen=True)
class StatusMsg:
    operation: str
    progress: int
    message: str
    eta_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, options: OutputOptions | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "status",
            "operation": self.operation,
            "progress": self.progress,
            "message": self.message,
        }
        if self.eta_seconds is not None:
            out["eta_seconds"] = round(self.eta_seconds, 1)
        out.update(self.extra)
        return out


@dataclass(frozen=True)
class TokenMsg:
    """One generated token. ``token`` is the text released with it: empty while text is held back
    (a possible stop string, an incomplete UTF-8 character) and released with a later token."""

    token: str
    token_id: int
    generated_text: str  # cumulative, prefixed with the prompt when echo_prompt is set
    logprobs: list[LogprobEntry] | None  # the sampled token first, then the top alternatives
    token_s: float
    total_s: float
    finish_reason: str | None

    def to_json(self, options: OutputOptions) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "token", "token": self.token}
        if options.include_token_ids:
            out["token_id"] = self.token_id
        out["generated_text"] = self.generated_text
        if options.include_logprobs is not None and self.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob} for e in self.logprobs]
        if options.include_timing:
            out["timing"] = {"token_ms": _ms(self.token_s), "total_ms": _ms(self.total_s)}
        out["finish_reason"] = self.finish_reason
        out["finished"] = self.finish_reason is not None
        return out


@dataclass(frozen=True)
class CompletionMsg:
    request_id: str
    generated_text: str
    finish_reason: str  # "length" | "stop" | "cancelled" | "content_filter"
    usage: Usage
    first_token_s: float | None
    total_s: float
    stop_reason: str | int | None = None  # the stop string or requested stop token that ended it (vLLM's)

    def to_json(self, options: OutputOptions) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "completion",
            "request_id": self.request_id,
            "generated_text": self.generated_text,
            "finish_reason": self.finish_reason,
            "usage": self.usage.to_json(),
        }
        if options.include_timing:
            first = None if self.first_token_s is None else _ms(self.first_token_s)
            out["timing"] = {"first_token_ms": first, "total_ms": _ms(self.total_s)}
        return out


@dataclass(frozen=True)
class ErrorMsg:
    """An error. With a ``request_id`` it ends that generation; without one it refers to the client
    message just received and changes nothing else on the connection."""

    code: str
    message: str
    recoverable: bool
    recovery_action: str
    request_id: str | None = None
    generated_text: str | None = None  # the partial text, when some had been generated
    param: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def from_error(cls, exc: TillerError, request_id: str | None = None, generated_text: str | None = None) -> ErrorMsg:
        known = exc if exc.code in ERROR_TRAITS else TillerError(INTERNAL_ERROR, exc.message)
        return cls(
            code=known.code,
            message=exc.message,
            recoverable=known.recoverable,
            recovery_action=known.recovery_action,
            request_id=request_id,
            generated_text=generated_text,
            param=getattr(exc, "param", None),
            retry_after_s=getattr(exc, "retry_after_s", None),
        )

    @classmethod
    def from_failure(cls, failed: wire.RequestFailed, generated_text: str | None = None) -> ErrorMsg:
        """The scheduler's failure of a request (or the gateway's, in its shape) as the client sees it."""
        return cls(code=failed.code, message=failed.message, recoverable=failed.recoverable,
                   recovery_action=failed.recovery_action, request_id=failed.rid, generated_text=generated_text)

    @property
    def http_status(self) -> int:
        return ERROR_TRAITS.get(self.code, ERROR_TRAITS[INTERNAL_ERROR])[2]

    def to_json(self, options: OutputOptions | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "error",
            "error": self.code,
            "message": self.message,
            "recoverable": self.recoverable,
            "recovery_action": self.recovery_action,
            "request_id": self.request_id,
        }
        if self.generated_text:
            out["generated_text"] = self.generated_text
        if self.param is not None:
            out["param"] = self.param
        if self.retry_after_s is not None:
            out["retry_after"] = round(self.retry_after_s, 1)
        return out


ServerMsg = InitMsg | StatusMsg | TokenMsg | CompletionMsg | ErrorMsg
