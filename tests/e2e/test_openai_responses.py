"""The OpenAI Responses API through the official ``openai`` SDK on the real stack: plain, streamed (the SDK's
typed events), ``text.format`` json_schema, a function tool's full loop, a chain by ``previous_response_id``
whose later turns reuse cached KV and whose greedy text is the chat completion of the whole conversation (and
which survives a restart of every service), ownership, and the refusals."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
)

from tests.e2e.test_openai_tools import WEATHER

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


def respond(stack, client, **kwargs):
    return client.responses.create(model=stack.settings.served_model_name, temperature=0, **kwargs)


def chat_text(stack, client, messages, max_tokens) -> str:
    reply = client.chat.completions.create(model=stack.settings.served_model_name, messages=messages,
                                           max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def test_plain_response_is_the_chat_completion(stack, client):
    response = respond(stack, client, input="Name three colors.", instructions="You are terse.",
                       max_output_tokens=12, metadata={"case": "plain"})
    assert response.id.startswith("resp_") and response.object == "response" and response.metadata == {"case": "plain"}
    assert response.status in ("completed", "incomplete") and response.output[0].type == "message"
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    assert response.output_text == chat_text(stack, client, messages, 12)
    assert response.usage.output_tokens <= 12 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens)
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_streamed_events(stack, client):
    kwargs = dict(input="Name three colors.", max_output_tokens=12)
    events = list(respond(stack, client, stream=True, **kwargs))
    assert isinstance(events[0], ResponseCreatedEvent) and events[0].response.status == "in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    text = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    assert text == events[-1].response.output_text == respond(stack, client, **kwargs).output_text
    # the SDK's own stream helper accumulates the same events into the final response
    with client.responses.stream(model=stack.settings.served_model_name, temperature=0, **kwargs) as stream:
        assert stream.get_final_response().output_text == text


def test_text_format_json_schema(stack, client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    response = respond(stack, client, input=ASK, max_output_tokens=40,
                       text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "weather"


def test_function_tool_loop(stack, client):
    """function_call -> function_call_output -> answer, continued by previous_response_id and sent whole."""
    first = respond(stack, client, input=ASK, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                    max_output_tokens=40)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "London", "Tokyo") and call.call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}
    answer = respond(stack, client, previous_response_id=first.id, input=[result], tools=[TOOL], tool_choice="none",
                     max_output_tokens=12)
    assert answer.output[0].type == "message" and answer.output_text
    whole = respond(stack, client, input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result],
                    tools=[TOOL], tool_choice="none", max_output_tokens=12, store=False)
    assert whole.output_text == answer.output_text
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(whole.id)
    # streamed, the call's arguments come as typed deltas
    events = list(respond(stack, client, input=ASK, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                          max_output_tokens=40, stream=True))
    added = [e.item for e in events if isinstance(e, ResponseOutputItemAddedEvent)]
    assert [i.type for i in added] == ["function_call"] and added[0].arguments == ""
    streamed = "".join(e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent))
    done = [e.item for e in events if isinstance(e, ResponseOutputItemDoneEvent)]
    assert streamed == done[0].arguments == call.arguments and isinstance(events[-1], ResponseCompletedEvent)
    items = client.responses.input_items.list(answer.id)
    assert [i.type for i in items.data] == ["function_call_output"]


def _chain(stack, client, turns, previous=None):
    responses = []
    for text in turns:
        response = respond(stack, client, input=text, previous_response_id=previous, max_output_tokens=12)
        responses.append(response)
        previous = response.id
    return responses


def _whole(turns, responses):
    messages = []
    for text, response in zip(turns, responses, strict=True):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": response.output_text}]
    return messages[:-1]


TURNS = ["Name a color.", "Name another one.", "And a third?"]


def test_chain_reuses_kv_equals_chat_and_survives_restarts(stack, client):
    chain = _chain(stack, client, TURNS)
    assert [r.previous_response_id for r in chain] == [None, chain[0].id, chain[1].id]
    # each later turn forks the previous turn's parked KV: it prefills only what follows their shared tokens
    usage = [(r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens) for r in chain]
    for previous, turn in zip(chain, chain[1:]):
        shared = previous.usage.input_tokens + previous.usage.output_tokens - 1  # its last token was never fed
        assert turn.usage.input_tokens_details.cached_tokens >= shared > 0, usage
    assert chain[-1].output_text == chat_text(stack, client, _whole(TURNS, chain), 12)
    # a fork: two responses continue one parent
    fork = respond(stack, client, input="Name a fruit.", previous_response_id=chain[0].id, max_output_tokens=12)
    forked_turns = [TURNS[0], "Name a fruit."]
    assert fork.output_text == chat_text(stack, client, _whole(forked_turns, [chain[0], fork]), 12)

    result = stack._cli("restart", "all")
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{stack.http_url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the stack did not serve again after the restart"
        time.sleep(1)
    assert client.responses.retrieve(chain[-1].id).output_text == chain[-1].output_text
    (after,) = _chain(stack, client, ["One more."], previous=chain[-1].id)
    turns = [*TURNS, "One more."]
    assert after.output_text == chat_text(stack, client, _whole(turns, [*chain, after]), 12)


def test_ownership_delete_and_cancel(stack, client):
    mine = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                         default_headers={"x-user-id": "alice"})
    theirs = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                           default_headers={"x-user-id": "bob"})
    response = respond(stack, mine, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as caught:
        respond(stack, theirs, input="Hi", previous_response_id=response.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(response.id)
    with pytest.raises(openai.BadRequestError) as caught:
        mine.responses.cancel(response.id)
    assert "background" in caught.value.body["message"]
    mine.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(response.id)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (dict(tools=[{"type": "web_search"}]), "tools[0]", "built-in"),
        (dict(reasoning={"effort": "high"}), "reasoning", "does not reason"),
        (dict(background=True), "background", "background"),
        (dict(input=[{"type": "reasoning", "summary": []}]), "input[0]", "reasoning"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input[0]",
         "only text"),
        (dict(max_output_tokens=10**9), "max_output_tokens", "at most"),
        (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}), None, ""),
        (dict(tools=[TOOL], tool_choice={"type": "function", "name": "nope"}), "tool_choice", "nope"),
        (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "?"}]), "input", "call_x"),
    ],
)
def test_refusals_name_the_field(stack, client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        respond(stack, client, **{"input": "Hi", "max_output_tokens": 2, **fields})
    body = caught.value.body
    assert body["type"] == "invalid_request_error" and words in body["message"], body
    if param is not None:
        assert (body["param"] or "").startswith(param), body


def test_unknown_response_is_404(stack, client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve("resp_nope")
    assert caught.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        respond(stack, client, input="Hi", previous_response_id="resp_nope", max_output_tokens=2)
