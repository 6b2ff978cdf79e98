"""The Responses API's pure translation: input items into chat messages and a chat request, refusals naming the
Responses fields, and the output builder's items and events for text, calls and a call cut by the limit."""

from __future__ import annotations

import json

import pytest

from services.gateway.protocol import GatewayError
from services.gateway.responses_format import OutputBuilder, ResponsesRequest, chat_messages, ending
from services.gateway.validation import validate
from tests.gateway.test_tool_calls import CALL, TWO_CALLS, WEATHER, context

TOOL = {"type": "function", **WEATHER["function"]}
TIME = {"type": "function", "name": "get_time"}


def parse(**fields) -> ResponsesRequest:
    return validate(ResponsesRequest, {"input": "Hi", **fields}, context())


def test_input_items_become_chat_messages():
    items = [
        {"role": "user", "content": "Weather in Paris?"},  # no type: a message
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sunny"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ]
    request = parse(input=items, instructions="Be brief.")
    listed = request.input_items()
    assert [i["type"] for i in listed] == ["message", "function_call", "function_call_output", "message"]
    assert all(i["id"] for i in listed)
    assert listed[0]["content"] == [{"type": "input_text", "text": "Weather in Paris?"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    assert chat_messages(listed) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    chat = request.chat_request([], context())
    assert chat.messages[0].role == "system" and chat.messages[0].content == "Be brief."
    # a call after an assistant's text joins that message, as a chat reply carries both
    joined = chat_messages([listed[3], listed[1]])
    assert joined == [{"role": "assistant", "content": "Sunny.", "tool_calls": [call]}]


def test_the_chat_request_it_runs_as():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = parse(max_output_tokens=30, temperature=0, top_p=0.5, tools=[TOOL, TIME], parallel_tool_calls=False,
                    tool_choice={"type": "function", "name": "get_time"},
                    text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    chat = request.chat_request([{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                  "text": "Before"}]}], context())
    assert [m.content for m in chat.messages] == ["Before", "Hi"]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.parallel_tool_calls) == (30, 0, 0.5, False)
    assert chat.tool_choice.function.name == "get_time" and chat.response_format.output_schema() == schema
    (generation,) = chat.to_requests(context())
    assert json.loads(generation.controller_arg)["lark"] == chat.tool_plan.grammar(schema)
    echoed = request.echo()
    assert echoed["tool_choice"] == {"type": "function", "name": "get_time"} and echoed["text"]["format"]["name"] == "a"
    assert parse().chat_request([], context()).tool_plan is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (dict(tools=[{"type": "file_search"}]), "tools[0]"),
        (dict(reasoning={"effort": "low"}), "reasoning"),
        (dict(truncation="auto"), "truncation"),
        (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0]"),
        (dict(metadata={str(i): "v" for i in range(17)}), "metadata"),
        (dict(tool_choice={"type": "function", "name": "nope"}, tools=[TOOL]), "tool_choice"),
        (dict(max_output_tokens=10**9), "max_output_tokens"),  # the chat limit, named as the Responses field
        (dict(input=[]), "input"),  # no message at all
    ],
)
def test_refusals_name_the_responses_field(fields, param):
    with pytest.raises(GatewayError) as caught:
        parse(**fields).chat_request([], context())
    assert (caught.value.param or "").startswith(param), caught.value
    assert caught.value.message.startswith(param.split("[")[0]), caught.value


def kinds(events) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_text_output_and_its_events():
    builder = OutputBuilder(None)
    events = builder.feed("Hel") + builder.feed("lo") + builder.close("length")
    assert kinds(events) == ["output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
                             "output_text.done", "content_part.done", "output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["item"]["content"] == [] and events[1]["part"]["text"] == ""  # snapshots, not the live item
    (item,) = builder.items
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Hello" and events[-1]["item"] == item
    assert ending("length") == ("incomplete", "max_output_tokens") and ending("tool_calls") == ("completed", None)


def test_calls_output_and_a_call_cut_by_the_limit():
    plan = parse(tools=[TOOL, TIME], tool_choice="required").chat_request([], context()).tool_plan
    builder = OutputBuilder(plan)
    events = builder.feed(TWO_CALLS) + builder.close("stop")
    assert kinds(events) == ["output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
                             "output_item.done"] * 2
    assert [(i["name"], i["arguments"], i["status"]) for i in builder.items] == [
        ("get_weather", '{"city":"Paris"}', "completed"), ("get_time", "{}", "completed")]
    assert builder.items[0]["call_id"].startswith("call_") and builder.items[0]["id"].startswith("fc_")

    cut = OutputBuilder(plan)
    events = cut.feed(CALL + "\n" + CALL[:50]) + cut.close("length")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["status"] for d in done] == ["completed", "incomplete"]  # streamed, the cut call ends incomplete
    assert [i["arguments"] for i in cut.items] == ['{"city":"Paris"}']  # and is not in the output
