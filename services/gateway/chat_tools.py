"""A chat request's messages and tools as the OpenAI API takes them (chat completions, ``/tokenize`` for
messages, and the Responses API, which is translated into a chat request).

Messages come back the way clients send them: an assistant message that made tool calls may have no
``content`` (or null), as OpenAI accepts and ``message.model_dump(exclude_none=True)`` sends; a ``tool``
message answers one of those calls by its ``tool_call_id``; content may be a list of text parts.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from services.gateway.tool_calls import Tool, ToolCallIn, ToolChoice, ToolPlan, render_messages
from services.gateway.validation import ChatMessage, context_of


class ToolChatMessage(ChatMessage):
    """A chat message of the OpenAI API: an assistant's may carry the tool calls it made (then its content
    may be left out), a tool's names the call it answers."""

    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "assistant" and data.get("tool_calls"):
            return {"content": None, **data}  # the calls are the message: its content may be left out
        return data

    @model_validator(mode="after")
    def _tool_answers_a_call(self) -> ToolChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role 'tool' needs the 'tool_call_id' of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message carries tool_calls, not one of role {self.role!r}")
        return self


def _unanswerable(messages: list[ToolChatMessage]) -> str | None:
    """Why a tool message answers no call made before it (by an assistant message with tool_calls), if one does not."""
    made: set[str] = set()
    for i, message in enumerate(messages):
        made.update(call.id for call in message.tool_calls or [])
        if message.role == "tool" and message.tool_call_id not in made:
            known = f"the calls made before it are {sorted(made)}" if made else \
                "no assistant message before it made one"
            return f"message {i} (role 'tool') answers {message.tool_call_id!r}, no tool call made before it ({known})"
    return None


class ChatTools(BaseModel):
    """A chat request's tools, as they enter its prompt."""

    messages: Annotated[list[ToolChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("messages")
    @classmethod
    def _answers_follow_calls(cls, value: list[ToolChatMessage]) -> list[ToolChatMessage]:
        problem = _unanswerable(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("tools")
    @classmethod
    def _tools_available(cls, value: list[Tool] | None, info: ValidationInfo) -> list[Tool] | None:
        if value and context_of(info).json_controller is None:
            raise ValueError("constrained tool calls are not enabled on this server")
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError(f"function names must differ, got {names}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = [t.function.name for t in info.data.get("tools") or []]
        if value not in (None, "none") and not names:
            raise ValueError("needs tools (as OpenAI)")
        if isinstance(value, BaseModel) and value.function.name not in names:
            raise ValueError(f"names function {value.function.name!r}, which is not among the tools {names}")
        return value

    @property
    def tool_plan(self) -> ToolPlan | None:
        if not self.tools:
            return None
        plan = ToolPlan(self.tools, self.tool_choice or "auto", self.parallel_tool_calls)
        return plan if plan.may_call else None

    def rendered_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template gets them (tool calls as text, the tools in the system message)."""
        return render_messages(self.messages, self.tool_plan)
