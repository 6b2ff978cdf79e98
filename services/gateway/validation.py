"""Validation of client requests (pydantic), shared by every surface.

Models are strict (no string-to-number coercion) and validated with a :class:`Context` carrying the
limits from Settings; every failure becomes a :class:`GatewayError` ``invalid_request`` whose message
names the field, e.g. ``parameters.temperature: Input should be greater than or equal to 0 (got -1)``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common import aici_wire
from common.config import Embeddings, Limits, Settings, Steering
from common.errors import INVALID_REQUEST
from common.pooling import Pooling
from common.wire import SamplingParams, SamplingPatch
from services.gateway.json_body import parse_json
from services.gateway.protocol import GatewayError

CLIENT_MESSAGE_TYPES = ("config", "control", "feedback")
# ``include_logprobs: true`` asks for the sampled token and this many top alternatives.
DEFAULT_TOP_LOGPROBS = 5


@dataclass(frozen=True)
class Context:
    limits: Limits
    served_model_name: str
    json_controller: str | None = None  # the controller enforcing JSON output (``native:<name>``), if any
    embeddings: Embeddings = field(default_factory=Embeddings)
    steering: Steering = field(default_factory=Steering)

    @classmethod
    def of(cls, settings: Settings) -> Context:
        name = settings.controllers.response_format
        json_controller = f"native:{name}" if name and name in settings.controllers.native else None
        return cls(settings.limits, settings.served_model_name, json_controller, settings.embeddings,
                   settings.steering)


def context_of(info: ValidationInfo) -> Context:
    if not isinstance(info.context, Context):  # a programming error, not bad input
        raise RuntimeError("gateway models must be validated with a validation.Context")
    return info.context


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _logprobs_flag(value: Any) -> Any:
    if value is True:
        return DEFAULT_TOP_LOGPROBS
    if value is False:
        return None
    return value


def _message_content(value: Any) -> Any:
    """OpenAI-style content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError("content parts must be {'type': 'text', 'text': <string>} (only text is supported)")
            texts.append(part["text"])
        return "".join(texts)
    return value


# Integers travel to the scheduler and the worker as msgpack int64 (a torch seed too): larger ones are
# refused here, not failed on the way.
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]


def wrap_int64(value: int) -> int:
    """``value`` wrapped into the int64 range (derived seeds)."""
    return (value + INT64_MAX + 1) % 2**64 - INT64_MAX - 1
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=0, le=INT64_MAX)]
RepetitionPenalty = Annotated[float, Field(gt=0)]
MaxTokens = Annotated[int, Field(ge=1)]
StopList = Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(_as_list)]
MAX_CACHE_SALT_CHARS = 1024
# vLLM's cache_salt: KV is shared only with requests of the same cache domain and salt (docs/tenants.md)
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
TopLogprobs = Annotated[Annotated[int, Field(ge=0)] | None, BeforeValidator(_logprobs_flag)]
# A request's activation steering as the client gave it: a list of {"vector", "scale", "layers"?, "positions"?}
# objects, checked and resolved in one place (services.gateway.steering.resolve_steering; docs/steering.md)
SteeringSpec = list[dict[str, Any]]


class NullIsLeftOut(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        """A field given as JSON null takes its default, as if left out (``"stop": null`` as ``"model": null``)."""
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StrictModel(NullIsLeftOut):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class LimitChecks(BaseModel):
    """Checks against the configured limits, for any model with these field names."""

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _max_tokens_cap(cls, value: int | None, info: ValidationInfo) -> int | None:
        limits = context_of(info).limits
        if value is not None and value > limits.max_tokens_cap:
            raise ValueError(f"must be at most {limits.max_tokens_cap} (got {value}), and fit beside the prompt in the "
                             f"model's context of {limits.max_model_len} tokens")
        return value

    @field_validator("stop", check_fields=False)
    @classmethod
    def _stop_count(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        cap = context_of(info).limits.max_stop_strings
        if value is not None and len(value) > cap:
            raise ValueError(f"at most {cap} stop strings are allowed (got {len(value)})")
        return value

    @field_validator("logit_bias", "stop_token_ids", check_fields=False)
    @classmethod
    def _token_list_cap(cls, value: Any, info: ValidationInfo) -> Any:
        cap = context_of(info).limits.max_token_biases
        if value is not None and len(value) > cap:
            raise ValueError(f"at most {cap} token ids are allowed (got {len(value)})")
        return value

    @field_validator("n", check_fields=False)
    @classmethod
    def _choices_cap(cls, value: int, info: ValidationInfo) -> int:
        cap = context_of(info).limits.max_choices
        if value > cap:
            raise ValueError(f"must be at most {cap} (got {value})")
        return value

    @field_validator("include_logprobs", "logprobs", "top_logprobs", check_fields=False)
    @classmethod
    def _top_logprobs_cap(cls, value: Any, info: ValidationInfo) -> Any:
        cap = context_of(info).limits.max_top_logprobs
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            raise ValueError(f"must be at most {cap} (got {value})")
        return value


class Parameters(StrictModel, LimitChecks):
    max_tokens: MaxTokens | None = None  # None: limits.default_max_tokens, capped by the context
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: StopList = []
    seed: Int64 | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past EOS (benchmarks)
    cache_salt: CacheSalt | None = None
    steering: SteeringSpec | None = None

    def request_fields(self) -> dict[str, Any]:
        """These parameters as keyword arguments of :class:`GenerationRequest`."""
        fields = self.model_dump(include=set(Parameters.model_fields))  # not a subclass's extra fields
        fields["stop"] = tuple(self.stop)
        return fields


class ParametersPatch(StrictModel, LimitChecks):
    """``control: modify`` parameters: the same fields and rules, each optional."""

    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopList | None = None
    seed: Int64 | None = None
    steering: SteeringSpec | None = None  # the request's whole steering from the next token on ([]: none)

    @model_validator(mode="after")
    def _not_empty(self) -> ParametersPatch:
        if not self.model_fields_set:
            raise ValueError("give at least one parameter to modify")
        return self

    def to_patch(self) -> SamplingPatch:
        """The patch without its steering, which the driver resolves (vector tags and ids) and adds."""
        return SamplingPatch(**self.model_dump(exclude_unset=True, exclude={"steering"}))


class Options(StrictModel, LimitChecks):
    stream: bool = True
    echo_prompt: bool = False
    include_token_ids: bool = False
    include_logprobs: TopLogprobs = None  # true: DEFAULT_TOP_LOGPROBS alternatives; n: n alternatives
    include_timing: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # OpenAI clients send name, tool_calls, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, BeforeValidator(_message_content)]


# what the rendering itself gives a chat template (or transformers' apply_chat_template takes for itself): not
# for a request's chat_template_kwargs to replace (vLLM refuses chat_template and tokenize there too)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


class ChatRendering(BaseModel):
    """How chat messages end as a prompt (vLLM's options): with the template's generation prompt, or
    with the last message, the assistant's, left open for the model to continue; ``chat_template_kwargs``
    are more variables for the template (vLLM's; e.g. ``enable_thinking``: one the template does not use
    changes nothing, as in vLLM, which drops those)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & (value or {}).keys())
        if reserved:
            raise ValueError(f"{', '.join(map(repr, reserved))} cannot be set here (the request's own fields "
                             "set how its messages are rendered)")
        return value

    @model_validator(mode="after")
    def _one_way_to_end(self) -> ChatRendering:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false (they end the prompt differently)")
        messages = getattr(self, "messages", None)
        if self.continue_final_message and messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def rendering(self) -> dict[str, bool]:
        """These options as keyword arguments of :class:`GenerationRequest`."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs or None}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request in surface-neutral form: what the generation driver runs."""

    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True  # how ``messages`` end (see ChatRendering)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (vLLM's)
    prompt_ids: list[int] | None = None
    max_tokens: int | None = None  # None: default_max_tokens, capped by the context
    default_max_tokens: int | None = None  # the surface's default for max_tokens; None: limits.default_max_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # vLLM's
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias added to its logit
    presence_penalty: float = 0.0  # OpenAI's, on generated tokens
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # no stop token (EOS unless ignored, stop_token_ids) before this many
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False  # the stop string that ends the generation stays in its text (vLLM's)
    skip_special_tokens: bool = True  # special tokens have no text (vLLM's)
    priority: int = 0  # the scheduler's order: lower first (0 interactive ... 10 batch)
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: any of these ends the generation (its text is not output)
    top_logprobs: int | None = None  # None: no logprobs
    # the alternatives are the most likely tokens other than the chosen one (the WebSocket protocol's list, where
    # the chosen token comes first); else the most likely ones, the chosen one among them if it is (OpenAI's)
    alternatives_besides: bool = False
    prompt_logprobs: bool = False  # the prompt tokens' logprobs too, with top_logprobs alternatives each
    echo: bool = False
    ignore_eos: bool = False
    controller: str | None = None  # module id, tag or native:<name> steering the generation (the AICI runtime protocol)
    controller_arg: str = ""
    # a turn of a chain (a stored response): its KV is parked under ``park_as`` for the next turn, and it may
    # fork the KV parked under ``continues`` (the previous turn), as a Salience session's turn does
    park_as: str = ""
    continues: str = ""
    cache_salt: str | None = None  # vLLM's: shares KV only with requests of the same domain and salt
    steering: SteeringSpec | None = None  # activation steering as the client gave it (docs/steering.md)
    pooling: Pooling | None = None  # with max_tokens 0: the prompt's embedding (common.pooling), not its tokens
    # with max_tokens 0: the last prompt position's residual stream after these 0-based layers (vectors:build)
    residual_layers: tuple[int, ...] = ()

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            logprobs=None if self.top_logprobs is None else self.top_logprobs + self.alternatives_besides,
            logit_bias=dict(self.logit_bias or {}),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens,
        )

    def written_text(self, prompt_text: str) -> str:
        """What the client wrote (what the content filter screens): chat messages' contents and the texts in
        the chat template's variables, not the template; else the prompt."""
        if self.messages is None:
            return prompt_text
        return "\n".join([*(m["content"] for m in self.messages), *_texts(self.chat_template_kwargs)])

    def patched(self, patch: SamplingPatch) -> GenerationRequest:
        """This request with a mid-stream modification applied (what ``regenerate`` runs next)."""
        changes = {
            f.name: getattr(patch, f.name) for f in dataclasses.fields(self)
            if f.name != "steering" and getattr(patch, f.name, None) is not None
        }
        if "stop" in changes:
            changes["stop"] = tuple(changes["stop"])
        return dataclasses.replace(self, **changes)

    def record(self) -> dict[str, Any]:
        """The parameters as stored with the request record."""
        out = dataclasses.asdict(self)
        for key in ("prompt", "messages", "prompt_ids", "controller_arg", "cache_salt"):
            out.pop(key)
        out["stop"] = list(self.stop)
        return out


def _texts(value: Any) -> list[str]:
    """The strings in a JSON value (the keys of its objects too)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for key, item in value.items() for text in (key, *_texts(item))]
    if isinstance(value, list):
        return [text for item in value for text in _texts(item)]
    return []


class GenerateConfig(StrictModel, LimitChecks):
    """The WebSocket ``config`` message (without ``type``), and the normalized ``/v1/generate`` body."""

    model: str | None = None
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    parameters: Parameters = Parameters()
    options: Options = Options()
    controller: Annotated[str, Field(min_length=1)] | None = None
    controller_arg: Any = None  # a string, or JSON serialized to one (AICI's controller_arg)

    @field_validator("model")
    @classmethod
    def _served_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        served = context_of(info).served_model_name
        if value is not None and value != served:
            raise ValueError(f"model {value!r} is not served here; this server serves {served!r}")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateConfig:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (chat)")
        if self.controller_arg is not None and self.controller is None:
            raise ValueError("'controller_arg' needs a 'controller'")
        return self

    def to_request(self) -> GenerationRequest:
        return GenerationRequest(
            prompt=self.prompt,
            messages=None if self.messages is None else [m.model_dump() for m in self.messages],
            top_logprobs=self.options.include_logprobs,
            alternatives_besides=True,
            echo=self.options.echo_prompt,
            controller=self.controller,
            controller_arg=aici_wire.module_arg_text(self.controller_arg),
            **self.parameters.request_fields(),
        )




class ControlMessage(StrictModel):
    action: Literal["stop", "pause", "resume", "regenerate", "modify"]
    parameters: dict[str, Any] | None = None  # validated as ParametersPatch for ``modify``

    @model_validator(mode="after")
    def _parameters_only_for_modify(self) -> ControlMessage:
        if self.action == "modify" and self.parameters is None:
            raise ValueError("'modify' needs a 'parameters' object")
        if self.action != "modify" and self.parameters is not None:
            raise ValueError(f"'parameters' is only allowed with action 'modify', not {self.action!r}")
        return self


class FeedbackMessage(StrictModel):
    rating: Annotated[float, Field(ge=-1, le=1)]
    text: str | None = None
    position: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None


M = TypeVar("M", bound=BaseModel)


def _field_path(loc: tuple[int | str, ...], prefix: str) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else part
    return path


_PLAIN_MESSAGES = {
    "extra_forbidden": "unknown field",
    "model_type": "must be a JSON object",
    "dict_type": "must be a JSON object",
}


def _describe(error: dict[str, Any], prefix: str) -> tuple[str, str]:
    path = _field_path(tuple(error["loc"]), prefix)
    msg = _PLAIN_MESSAGES.get(error["type"]) or error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("value_error", "missing", *_PLAIN_MESSAGES):
        shown = json.dumps(error.get("input"), default=str)
        msg += f" (got {shown if len(shown) <= 40 else shown[:37] + '...'})"
    return path, (f"{path}: {msg}" if path else msg)


def validate(model: type[M], data: Any, context: Context, *, prefix: str = "") -> M:
    """Validate ``data`` against ``model``; failures raise ``invalid_request`` naming each field."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        described = [_describe(e, prefix) for e in exc.errors(include_url=False)]
        raise GatewayError(INVALID_REQUEST, "; ".join(m for _, m in described), param=described[0][0] or None) from None


def parse_client_message(raw: str | bytes, max_depth: int) -> dict[str, Any]:
    """A WebSocket frame as a message object with a known ``type``, or ``invalid_request``."""
    message = parse_json(raw, max_depth, "message")
    if not isinstance(message, dict):
        raise GatewayError(INVALID_REQUEST, f"message must be a JSON object, not {type(message).__name__}")
    kind = message.get("type")
    if kind is None:
        raise GatewayError(INVALID_REQUEST, "message has no 'type' field", param="type")
    if kind not in CLIENT_MESSAGE_TYPES:
        raise GatewayError(
            INVALID_REQUEST,
            f"type: unknown message type {kind!r}; expected one of {', '.join(CLIENT_MESSAGE_TYPES)}",
            param="type",
        )
    return message


def flat_body_to_config(body: dict[str, Any]) -> dict[str, Any]:
    """``/v1/generate`` takes the parameters and options at the top level (the WebSocket protocol's REST example)
    or nested as in the WebSocket config (also a whole config message, ``"type": "config"`` included); fold the
    flat form into the nested one."""
    config = dict(body)
    if config.get("type") == "config":
        del config["type"]
    for group, model in (("parameters", Parameters), ("options", Options)):
        nested = config.get(group, {})
        if not isinstance(nested, dict):
            continue  # reported by validation
        nested = dict(nested)
        for name in model.model_fields:
            if name in config:
                if name in nested:
                    raise GatewayError(
                        INVALID_REQUEST, f"{name}: given both at the top level and in '{group}'", param=name
                    )
                nested[name] = config.pop(name)
        if nested:
            config[group] = nested
    return config
