"""OpenAI tool calling through the official ``openai`` client on the real stack: a forced call whose
arguments follow the function's schema, streamed as OpenAI streams them, then the tool's result sent
back and the model's final answer."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from services.gateway.tool_calls import ToolPlan, Tool

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


def create(stack, client, **kwargs):
    return client.chat.completions.create(model=stack.settings.served_model_name, temperature=0, **kwargs)


def test_sdk_tool_calling_flow(stack, client):
    """call -> tool result -> final answer, as the openai SDK's documented flow runs it."""
    first = create(stack, client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                   parallel_tool_calls=False, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    schema = (WEATHER if call.function.name == "get_weather" else {"function": {"parameters": {"maxProperties": 0}}})
    jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])

    # the SDK's own message object goes back as it came, then the tool's result
    history = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    again = create(stack, client, messages=history, tools=[WEATHER, CLOCK], max_tokens=40)  # auto: the model picks
    picked = again.choices[0]
    if picked.message.tool_calls:  # a call (this model likes to call again): whole, and it parses
        assert picked.finish_reason == "tool_calls" and picked.message.content is None
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in picked.message.tool_calls)
    else:  # text, which never opens a call
        assert picked.finish_reason in ("stop", "length") and not picked.message.content.startswith("<tool_call>")
    # the prompt held the call as written and the result as a tool message, the tools in the system message
    plan = ToolPlan([Tool.model_validate(WEATHER), Tool.model_validate(CLOCK)])
    written = f'<tool_call>\n{{"name":"{call.function.name}","arguments":{call.function.arguments}}}\n</tool_call>'
    rendered = stack.tokenizer.apply_chat_template(
        [{"role": "system", "content": plan.system_text()}, *ASK, {"role": "assistant", "content": written},
         {"role": "tool", "content": "Sunny, 21 degrees."}], add_generation_prompt=True, tokenize=False)
    assert again.usage.prompt_tokens == len(stack.tokenizer(rendered, add_special_tokens=False).input_ids)

    final = create(stack, client, messages=history, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=8)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content and answer.finish_reason in ("stop", "length")


def test_streamed_calls_equal_the_whole_reply(stack, client):
    """Parallel calls stream as vLLM streams them: each opens with its id and name, its arguments
    follow in pieces; joined they equal the unstreamed reply's calls."""
    ask = dict(messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               max_tokens=30)
    whole = create(stack, client, **ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert json.loads(whole.message.tool_calls[0].function.arguments)["city"] in ("Paris", "London", "Tokyo")
    chunks = list(create(stack, client, **ask, stream=True, stream_options={"include_usage": True}))
    calls: dict[int, dict] = {}
    for chunk in chunks[:-1]:
        for part in chunk.choices[0].delta.tool_calls or []:
            if part.id is not None:
                assert part.index not in calls and part.type == "function"
                calls[part.index] = {"name": part.function.name, "arguments": ""}
            calls[part.index]["arguments"] += part.function.arguments or ""
        assert not chunk.choices[0].delta.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []


def test_tool_choice_none_answers_in_text(stack, client):
    reply = create(stack, client, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    plain = create(stack, client, messages=ASK, max_tokens=4)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == plain.choices[0].message.content  # the tools are not in the prompt
    with pytest.raises(openai.BadRequestError) as caught:
        create(stack, client, messages=ASK, tools=[WEATHER], max_tokens=4,
               tool_choice={"type": "function", "function": {"name": "get_news"}})
    assert caught.value.body["param"] == "tool_choice" and "get_news" in caught.value.body["message"]


def test_tokenize_counts_a_chat_request_with_its_tools(stack, client):
    """vLLM's /tokenize takes a chat request's ``tools`` (and ``tool_choice``): its count is the prompt tokens
    that chat request reports, with the tools described and earlier calls written as the model wrote them."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        def count(**body) -> int:
            response = http.post("/tokenize", json={"messages": history, **body})
            assert response.status_code == 200, response.text
            return response.json()["count"]

        counts = {choice: count(tools=[WEATHER, CLOCK], tool_choice=choice) for choice in ("auto", "none")}
        bare = count()
        refused = http.post("/tokenize", json={"prompt": "Hi", "tools": [WEATHER]})
    for choice, counted in counts.items():
        reply = create(stack, client, messages=history, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=1)
        assert reply.usage.prompt_tokens == counted, choice
    assert counts["none"] == bare < counts["auto"]  # tools the model may not call are not described
    assert refused.status_code == 400 and "'tools' go with 'messages'" in refused.json()["error"]["message"]


def test_messages_sent_back_as_dicts(stack, client):
    """The flow as frameworks send it: the assistant message as ``model_dump(exclude_none=True)`` (tool_calls, no
    content key), the tool's result as a list of text parts; the prompt is the one the SDK's objects make."""
    first = create(stack, client, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                   max_tokens=40)
    message = first.choices[0].message
    dumped = message.model_dump(exclude_none=True)
    assert "content" not in dumped and dumped["tool_calls"]
    (call,) = message.tool_calls
    result = [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "21 degrees."}]
    as_dicts = [*ASK, dumped, {"role": "tool", "tool_call_id": call.id, "content": result}]
    as_objects = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    replies = [create(stack, client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8)
               for history in (as_dicts, as_objects)]
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:  # a result naming no call made before it
        create(stack, client, messages=[*ASK, dumped, {"role": "tool", "tool_call_id": "call_x", "content": "?"}],
               tools=[WEATHER], max_tokens=8)
    assert caught.value.body["param"] == "messages" and "'call_x'" in caught.value.body["message"]


def test_length_cut_inside_a_call(stack, client):
    """max_tokens ends the reply inside a call's arguments: finish_reason ``length``, and the unstreamed reply
    shows no call with cut arguments (the streamed one sent them as they came: its finish reason says so)."""
    ask = dict(messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=12)
    cut = create(stack, client, **ask).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None and cut.message.content is None
    chunks = list(create(stack, client, **ask, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    streamed = "".join(p.function.arguments or "" for c in chunks for p in c.choices[0].delta.tool_calls or [])
    with pytest.raises(json.JSONDecodeError):
        json.loads(streamed)


@pytest.mark.parametrize("max_tokens", [40, 60, 90])
def test_parallel_calls_fit_in_max_tokens(stack, client, max_tokens):
    """tool_choice required with parallel calls (this model calls again and again): the calls stop before one
    that would not fit, so every call the reply shows parses and the reply ends as made, short of max_tokens
    (the issue's case: at 60 tokens the next call was cut mid-string)."""
    reply = create(stack, client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=max_tokens)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and reply.usage.completion_tokens < max_tokens
    assert len(choice.message.tool_calls) >= max_tokens // 30  # about 25 tokens a call: as many as fit
    for call in choice.message.tool_calls:
        assert isinstance(json.loads(call.function.arguments), dict)
