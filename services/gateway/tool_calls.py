"""OpenAI tool calling: the request's tools, how they enter the prompt, the grammar that constrains the
model's calls, and the parser that turns generated text back into ``tool_calls``.

A call is written in one format, whatever the model (its chat template is not asked; most small
templates know no tools)::

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

with several calls separated by a newline. The prompt describes the tools and this format in a system
message; assistant messages with ``tool_calls`` are rendered back in it, tool results are messages of
role ``tool``. Generation runs under a Lark grammar (llguidance, through the JSON controller) whose
``arguments`` follow each function's JSON schema, compact, so every completed call parses. Under
``auto`` the grammar allows either free text that does not open with the call tag, or calls; the
model picks with its first tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
SEPARATOR = "\n"
_ARGS_END = "}" + CALL_CLOSE  # the envelope's closing brace, then the tag (compact JSON has no raw newline)
_HEADER = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # llguidance: no optional whitespace in JSON


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # strict: arguments follow the schema anyway

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: dict(_NO_PARAMETERS))  # OpenAI: none given, none taken


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(BaseModel):
    """A call of an earlier assistant message, sent back in the conversation."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str = ""
    type: Literal["function"] = "function"
    function: CalledFunction


def format_call(name: str, arguments: str) -> str:
    """One call as the model writes it (``arguments`` is JSON text, kept as sent)."""
    return f'{CALL_OPEN}{{"name":{json.dumps(name)},"arguments":{arguments or "{}"}}}{CALL_CLOSE}'


def assistant_content(content: str, calls: list[ToolCallIn]) -> str:
    """An assistant message's text with its calls written out after it."""
    return SEPARATOR.join([content] * bool(content) + [format_call(c.function.name, c.function.arguments) for c in calls])


@dataclass(frozen=True)
class ToolPlan:
    """What a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for."""

    tools: list[Tool]
    choice: ToolChoice = "auto"
    parallel: bool = True

    @property
    def may_call(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def may_answer_text(self) -> bool:
        return self.choice == "auto"

    @property
    def several(self) -> bool:
        """Whether a call may follow a call (``parallel_tool_calls``, not one named function)."""
        return self.parallel and not isinstance(self.choice, NamedToolChoice)

    def callable(self) -> list[Tool]:
        if isinstance(self.choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.choice.function.name]
        return self.tools

    def system_text(self) -> str:
        """The tools and the call format, for the prompt's system message."""
        lines = [json.dumps(t.function.model_dump(exclude_none=True)) for t in self.callable()]
        return (
            "You can call these functions (their arguments are JSON following `parameters`):\n"
            + "\n".join(lines)
            + "\nTo call one, reply with exactly\n"
            + format_call("<function name>", "<arguments as JSON>")
            + "\n(one such block per call). Results come back in messages of role `tool`."
        )

    def grammar(self, text_schema: dict[str, Any] | None = None) -> str:
        """The Lark grammar (llguidance's dialect) of the model's reply. ``text_schema``: the JSON
        schema a text answer must follow (a JSON response_format), if any."""
        bodies = [
            {"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
             "required": ["name", "arguments"], "additionalProperties": False}
            for t in self.callable()
        ]
        rules = [
            "calls: call (" + json.dumps(SEPARATOR) + " call)*" if self.several else "calls: call",
            f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}",
            f"body: %json {json.dumps({**_COMPACT, 'anyOf': bodies})}",
        ]
        if not self.may_answer_text:
            return "\n".join(["start: calls", *rules])
        if text_schema is not None:
            text = f"text: %json {json.dumps({**_COMPACT, **text_schema})}"
        else:  # anything that does not open a call
            text = f"text: TEXT\nTEXT: /(?s:.*)/ & ~/{re.escape(CALL_OPEN.strip())}(?s:.*)/"
        return "\n".join(["start: text | calls", text, *rules])


def render_messages(messages: list[Any], plan: ToolPlan | None) -> list[dict[str, str]]:
    """Chat messages (with ``tool_calls`` / role ``tool``) as plain role/content messages for any
    chat template, the tools described in the system message (the first one, or a new first one)."""
    out = [
        {"role": m.role, "content": assistant_content(m.content, m.tool_calls) if m.tool_calls else m.content}
        for m in messages
    ]
    if plan is not None and plan.may_call:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{plan.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": plan.system_text()})
    return out


# -- the model's reply back into calls --------------------------------------------------------------


@dataclass
class CallDelta:
    """A piece of call ``index``: its opening (``id`` and ``name``) and/or more of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class ReplyDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: ReplyDelta) -> None:
        self.content += other.content
        for call in other.calls:
            if self.calls and self.calls[-1].index == call.index:
                self.calls[-1].arguments += call.arguments
            else:
                self.calls.append(call)


def _held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker`` (may complete it later)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReplyParser:
    """Splits a reply, fed in pieces as it streams, into content and tool calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._state = "deciding" if plan.may_answer_text else "calls"
        self._buffer = ""
        self._in_args = False
        self.calls = 0  # calls opened so far
        self.completed = 0  # calls closed so far
        self.cut: int | None = None  # the call whose arguments the end of the reply cut, if one was

    def feed(self, text: str) -> ReplyDelta:
        self._buffer += text
        out = ReplyDelta()
        if self._state == "deciding":
            if self._buffer.startswith(CALL_OPEN):
                self._state = "calls"
            elif not CALL_OPEN.startswith(self._buffer):
                self._state = "text"
        if self._state == "text":
            out.content, self._buffer = self._buffer, ""
        elif self._state == "calls":
            while self._step(out):
                pass
        return out

    def _step(self, out: ReplyDelta) -> bool:
        """Take what the buffer completes; whether to look again."""
        buffer = self._buffer
        if not self._in_args:
            lead = (SEPARATOR if self.calls else "") + CALL_OPEN
            match = _HEADER.match(buffer, len(lead)) if buffer.startswith(lead) else None
            if match is None:
                return False
            self._buffer = buffer[match.end():]
            self._in_args = True
            out.calls.append(CallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", json.loads(match.group(1))))
            self.calls += 1
            return True
        end = buffer.find(_ARGS_END)
        if end >= 0:
            self._emit_args(out, buffer[:end])
            self._buffer = buffer[end + len(_ARGS_END):]
            self._in_args = False
            self.completed += 1
            return True
        keep = _held_back(buffer, _ARGS_END)
        self._emit_args(out, buffer[: len(buffer) - keep])
        self._buffer = buffer[len(buffer) - keep:]
        return False

    def _emit_args(self, out: ReplyDelta, text: str) -> None:
        if text:
            out.add(ReplyDelta(calls=[CallDelta(self.calls - 1, text)]))

    def close(self) -> ReplyDelta:
        """The rest at the end of the reply: a reply cut short (``length``) leaves its last call's
        arguments unfinished, or a call that never got its name (nothing of it was sent), or text that
        never became a call, which is content."""
        rest, self._buffer = self._buffer, ""
        if self._state == "calls" and not self._in_args and rest.strip():
            self.cut = self.calls
            return ReplyDelta()
        if self._in_args:
            self._in_args = False
            if SEPARATOR in rest:  # the envelope's brace and part of the closing tag: the arguments were whole
                rest = ""
            else:
                self.cut = self.calls - 1
            return ReplyDelta(calls=[CallDelta(self.calls - 1, rest)] if rest else [])
        return ReplyDelta(content=rest)

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: ``tool_calls`` when the reply ended normally with its calls made."""
        return "tool_calls" if reason == "stop" and self.completed else reason


def parse_reply(plan: ToolPlan, text: str) -> tuple[ReplyDelta, ReplyParser]:
    """A whole reply as content and its calls whose arguments are whole (and the parser, for the finish
    reason): a call whose arguments the end of the reply cut (``length``) is left out, never shown as made."""
    parser = ReplyParser(plan)
    reply = parser.feed(text)
    reply.add(parser.close())
    reply.calls = [call for call in reply.calls if call.index != parser.cut]
    return reply, parser
