"""The OpenAI Responses API in terms of chat completions, pure (no I/O).

A request's ``input`` items (messages, ``function_call``, ``function_call_output``), after the conversation a
``previous_response_id`` continues and under its ``instructions``, become chat messages; its other fields a chat
completions body, validated as :class:`ChatCompletionRequest`, so a response runs on the same generation path as
chat (prompt, tool grammar, ``text.format`` constraint). :class:`OutputBuilder` turns the generated reply into
output items and the typed stream events the ``openai`` SDK parses (``response.output_text.delta``, ...).
"""

from __future__ import annotations

import copy
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from common.errors import INVALID_REQUEST
from services.gateway.openai_api import ChatCompletionRequest
from services.gateway.protocol import GatewayError, Usage
from services.gateway.tool_calls import CallDelta, ReplyDelta, ReplyParser, ToolPlan
from services.gateway.validation import CacheSalt, Context, NullIsLeftOut, SteeringSpec, Temperature, TopP, validate

# chat request fields -> the Responses fields they come from (for error messages)
_FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
_REFUSED_HINT = "not supported by this server"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _part_text(part: Any, kinds: tuple[str, ...]) -> str:
    if not (isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str)):
        raise ValueError(f"content parts must be {{'type': one of {list(kinds)}, 'text': <string>}} (only text is "
                         "supported)")
    return part["text"]


def _text(kinds: tuple[str, ...]) -> Any:
    """Content as a string or a list of text parts (joined)."""
    def join(value: Any) -> Any:
        return "".join(_part_text(p, kinds) for p in value) if isinstance(value, list) else value

    return BeforeValidator(join)


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # status, ... as the SDK sends items back

    id: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str, _text(("input_text", "output_text", "text"))]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: Annotated[str, _text(("input_text", "output_text", "text"))]


def _typed(value: Any) -> Any:
    """An input item without ``type`` is a message (the SDK's EasyInputMessage)."""
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    return value


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type"),
                      BeforeValidator(_typed)]


def _as_items(value: Any) -> Any:
    """``input`` as a string is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


def _function_tool(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(f"type {value.get('type')!r}: OpenAI's built-in tools do not run here; only tools of type "
                         "'function' are supported")
    return value


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # strict: the arguments follow the schema anyway

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)  # description

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.json_schema or {}}}

    def to_json(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name or "output", "schema": self.json_schema or {},
                "strict": self.strict}


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: TextFormat = TextFormat(type="text")
    verbosity: Literal["medium"] | None = None  # the model's own: no other can be asked of it


def _refused(*neutral: Any, hint: str = _REFUSED_HINT) -> Any:
    def check(value: Any) -> Any:
        if value not in neutral:
            raise ValueError(hint)
        return value

    return Annotated[Any, BeforeValidator(check)]


class ResponsesRequest(NullIsLeftOut):
    """``POST /v1/responses``: what this server runs. Fields that change nothing here (``user``,
    ``prompt_cache_key``, ...) are ignored; those it cannot honour are refused naming the field."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: Annotated[list[InputItem], BeforeValidator(_as_items)] = []
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig = TextConfig()
    tools: list[Annotated[FunctionTool, BeforeValidator(_function_tool)]] = []
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    store: bool = True
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] = {}
    stream: bool = False
    cache_salt: CacheSalt | None = None  # vLLM's, as on chat completions: KV shared only within its domain and salt
    steering: SteeringSpec | None = None  # as on chat completions (docs/steering.md)
    reasoning: _refused(None, {}, hint="this model does not reason (no reasoning tokens to configure)") = None
    background: _refused(False, hint="background responses are not supported; stream instead") = None
    conversation: _refused(None, hint="conversations are not supported; continue with previous_response_id") = None
    prompt: _refused(None, hint="stored prompt templates are not supported; send input and instructions") = None
    include: _refused(None, [], hint="no extra output data (logprobs, ...) is available here") = None
    top_logprobs: _refused(None, 0, hint="logprobs are not supported on /v1/responses (use chat completions)") = None
    max_tool_calls: _refused(None, hint="not supported; bound the calls with parallel_tool_calls: false") = None
    truncation: _refused(None, "disabled", hint="only 'disabled': the input is never cut") = None

    @field_validator("metadata")
    @classmethod
    def _sixteen_pairs(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 16:
            raise ValueError(f"at most 16 pairs (got {len(value)})")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.name for t in info.data.get("tools") or []]
        if isinstance(value, NamedFunction) and value.name not in names:
            raise ValueError(f"names function {value.name!r}, which is not among the tools {names}")
        return value

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as OpenAI lists it (``input_items``): typed items with ids."""
        out = []
        for item in self.input:
            data = item.model_dump(exclude_none=True)
            if isinstance(item, MessageItem):
                kind = "output_text" if item.role == "assistant" else "input_text"
                data.update(content=[{"type": kind, "text": item.content}], status="completed")
                data.setdefault("id", new_id("msg"))
            else:
                data.setdefault("id", new_id("fc" if isinstance(item, FunctionCallItem) else "fco"))
            out.append(data)
        return out

    def chat_request(self, conversation: list[dict[str, Any]], context: Context) -> ChatCompletionRequest:
        """The chat completions request this response runs as: ``conversation`` (the items a previous response
        ended with) and this input, under the instructions."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": ([{"role": "system", "content": self.instructions}] if self.instructions else [])
            + chat_messages([*conversation, *self.input_items()]),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "response_format": self.text.format.to_chat() if self.text.format.type != "text" else None,
            "cache_salt": self.cache_salt,
            "steering": self.steering,
        }
        if self.tools:
            body["tools"] = [t.to_chat() for t in self.tools]
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
            body["parallel_tool_calls"] = self.parallel_tool_calls
        try:
            return validate(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None}, context)
        except GatewayError as exc:  # named as the Responses fields they came from
            param = exc.param or ""
            root = param.split(".")[0].split("[")[0]
            if root in _FIELD_NAMES:
                raise GatewayError(INVALID_REQUEST, exc.message.replace(root, _FIELD_NAMES[root], 1),
                                   param=param.replace(root, _FIELD_NAMES[root], 1)) from None
            raise

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "text": {"format": self.text.format.to_json()},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in self.tools],
            "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None},
            "background": False,
        }


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items (as :meth:`ResponsesRequest.input_items` lists them) as chat messages: a ``function_call``
    joins the assistant message before it (or makes one), a ``function_call_output`` is a ``tool`` message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def usage_of(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


# chat finish reasons -> (status, incomplete_details.reason)
_ENDINGS = {"length": ("incomplete", "max_output_tokens"), "content_filter": ("incomplete", "content_filter"),
            "cancelled": ("cancelled", None)}


def ending(finish_reason: str) -> tuple[str, str | None]:
    """A response's ``status`` and ``incomplete_details.reason`` after a generation ended with ``finish_reason``."""
    return _ENDINGS.get(finish_reason, ("completed", None))


class OutputBuilder:
    """A response's output items, built from its reply as it streams, with the events that say so (each a
    dict the SDK parses, ``sequence_number`` included): a text answer is one ``message`` item with one
    ``output_text`` part; each tool call a ``function_call`` item. A call whose arguments the end of the reply
    cut ends ``incomplete`` in the stream and is left out of :attr:`items` (never shown as made)."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self._parser = None if plan is None else ReplyParser(plan)
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self._open: dict[str, Any] | None = None  # the item still growing
        self._calls: dict[int, dict[str, Any]] = {}  # the reply's call index -> its item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._apply(ReplyDelta(content=text) if self._parser is None else self._parser.feed(text))

    def close(self, finish_reason: str) -> list[dict[str, Any]]:
        """The events that end the output; ``finish_reason`` is the generation's."""
        events = [] if self._parser is None else self._apply(self._parser.close())
        cut = None if self._parser is None else self._calls.get(self._parser.cut)  # type: ignore[arg-type]
        status = "incomplete" if finish_reason == "length" else "completed"
        events += self._finish_open(status)
        if cut is not None:
            self.items.remove(cut)
        return events

    def _apply(self, delta: ReplyDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.content:
            events += self._text(delta.content)
        for call in delta.calls:
            events += self._call(call)
        return events

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        self._open = item
        self.items.append(item)
        return self.event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        item = self._open
        if item is None or item["type"] != "message":
            events += self._finish_open("completed")
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            events.append(self._add(item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index(item),
                                     content_index=0, part=copy.deepcopy(part)))
        item["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._index(item),
                                 content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call: CallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:
            events += self._finish_open("completed")
            item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                    "arguments": "", "status": "in_progress"}
            self._calls[call.index] = item
            events.append(self._add(item))
        item = self._calls[call.index]
        if call.arguments:
            item["arguments"] += call.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self._index(item), delta=call.arguments))
        return events

    def _finish_open(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._index(item)
        if item["type"] == "message":
            item["status"] = status
            part = item["content"][0]
            events = [
                self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=copy.deepcopy(part)),
            ]
        else:  # a call is whole unless the reply's end cut its arguments
            cut = self._parser is not None and self._calls.get(self._parser.cut) is item  # type: ignore[arg-type]
            item["status"] = "incomplete" if cut else "completed"
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"])]
        return [*events, self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, known in enumerate(self.items) if known is item)
