"""OpenAI tool calling, the pure parts: request validation, prompt rendering, the grammar (run by the
real llguidance matcher on the default model's tokenizer) and the reply parser at every split."""

from __future__ import annotations

import json

import pytest

from common.config import Limits, Settings
from common.model_source import load_tokenizer, resolve_model
from services.controller_runtime.constraints import FINISHED, OK, REJECTED, Constraint, ConstraintKind
from services.controller_runtime.tokenizer import TokenizerInfo
from services.gateway.openai_api import ChatCompletionRequest
from services.gateway.protocol import GatewayError
from services.gateway.tool_calls import ReplyParser, parse_reply
from services.gateway.validation import Context, validate
from tests.gateway.test_openai_models import refusal

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'


def context() -> Context:
    """The default settings' context: the JSON controller (which runs tool grammars) is on."""
    return Context.of(Settings(served_model_name="tiny", limits=Limits()))


def chat(**fields) -> ChatCompletionRequest:
    return validate(ChatCompletionRequest, {"messages": ASK, **fields}, context())


@pytest.fixture(scope="module")
def tokenizer():
    settings = Settings()
    return load_tokenizer(settings), TokenizerInfo.from_directory(resolve_model(settings).directory)


def run_grammar(tokenizer, grammar: str, text: str, eos: bool = True) -> int:
    hf, info = tokenizer
    constraint = Constraint.create(info, ConstraintKind.LARK, grammar)
    ids = hf.encode(text, add_special_tokens=False) + ([info.eos_token] if eos else [])
    return constraint.commit(ids)


def test_plan_from_the_request_fields():
    assert chat().tool_plan is None
    assert chat(tools=[WEATHER], tool_choice="none").tool_plan is None
    plan = chat(tools=[WEATHER, TIME]).tool_plan
    assert plan.choice == "auto" and plan.parallel and plan.may_answer_text
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}).tool_plan
    assert [t.function.name for t in named.callable()] == ["get_time"] and not named.may_answer_text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (dict(tool_choice="required"), "tool_choice"),  # no tools
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
        (dict(tools=[{"type": "code_interpreter"}]), "tools[0].type"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    ],
)
def test_refusals(fields, param):
    with pytest.raises(GatewayError) as caught:
        chat(**fields)
    assert (caught.value.param or "").startswith(param), caught.value


def test_messages_as_clients_send_them_back():
    """An assistant message with tool_calls and no content (``model_dump(exclude_none=True)``) or null content,
    tool messages naming their call, content as text parts: as OpenAI takes them."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    parts = [{"type": "text", "text": "sun"}, {"type": "text", "text": "ny"}]
    result = {"role": "tool", "tool_call_id": "call_1", "content": parts}
    for assistant in ({"role": "assistant", "tool_calls": [call]},
                      {"role": "assistant", "content": None, "tool_calls": [call]}):
        (generation,) = chat(messages=[*ASK, assistant, result], tools=[WEATHER]).to_requests(context())
        rendered = [ASK[0], {"role": "assistant", "content": CALL}, {"role": "tool", "content": "sunny"}]
        assert generation.messages[1:] == rendered


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "assistant"}], "messages[0].content: Field required"),  # neither content nor calls
        ([{"role": "user"}], "messages[0].content: Field required"),
        ([{"role": "tool", "content": "sunny"}], "needs the 'tool_call_id'"),
        ([*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}], "no assistant message before it made one"),
        ([{"role": "assistant", "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "call_2", "content": "x"}], "message 1 (role 'tool') answers 'call_2'"),
        ([{"role": "user", "content": "x", "tool_calls": []}, *ASK], None),  # an empty list is no calls
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "only text is supported"),
    ],
)
def test_message_refusals(messages, message):
    if message is None:
        assert chat(messages=messages).messages[0].tool_calls == []
        return
    with pytest.raises(GatewayError) as caught:
        chat(messages=messages)
    assert message in caught.value.message and (caught.value.param or "").startswith("messages"), caught.value


def test_parallel_calls_get_the_request_budget():
    """Calls in a row end where the next would not fit in max_tokens (the controller's budget); one call
    (no parallel calls, a named function) needs none."""
    (parallel,) = chat(tools=[WEATHER, TIME], tool_choice="required", max_tokens=60).to_requests(context())
    assert json.loads(parallel.controller_arg)["budget"] == 60
    (default,) = chat(tools=[WEATHER, TIME]).to_requests(context())
    assert json.loads(default.controller_arg)["budget"] == Limits().default_max_tokens
    named = {"type": "function", "function": {"name": "get_time"}}
    for single in (dict(parallel_tool_calls=False), dict(tool_choice=named)):
        (generation,) = chat(tools=[WEATHER, TIME], max_tokens=60, **single).to_requests(context())
        assert "budget" not in json.loads(generation.controller_arg)


def test_tools_need_the_json_controller():
    # refusal() validates with a context without a JSON controller
    assert "not enabled" in refusal(ChatCompletionRequest, {"messages": ASK, "tools": [WEATHER]}).message


def test_the_request_runs_the_grammar_and_renders_tools_and_calls():
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = chat(tools=[WEATHER], tool_choice="required")
    request = request.model_copy(update={"messages": chat(messages=history).messages})
    (generation,) = request.to_requests(context())
    assert generation.controller == "native:constrained"
    arg = json.loads(generation.controller_arg)
    assert arg["lark"] == request.tool_plan.grammar() and arg["max_tokens"] == Limits().max_tokens_cap
    system, *rest = generation.messages
    assert system["role"] == "system" and '"name": "get_weather"' in system["content"] and "<tool_call>" in system["content"]
    assert rest == [ASK[0], {"role": "assistant", "content": CALL}, {"role": "tool", "content": "sunny"}]
    # an existing system message gets the tools; without tools (or with "none") nothing is added
    with_system = chat(messages=[{"role": "system", "content": "Be brief."}, *ASK], tools=[WEATHER])
    (generation,) = with_system.to_requests(context())
    assert generation.messages[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    (plain,) = chat(tools=[WEATHER], tool_choice="none").to_requests(context())
    assert plain.messages == ASK and plain.controller is None


def test_required_grammar_takes_only_schema_valid_calls(tokenizer):
    grammar = chat(tools=[WEATHER, TIME], tool_choice="required").tool_plan.grammar()
    assert run_grammar(tokenizer, grammar, CALL) == FINISHED
    assert run_grammar(tokenizer, grammar, TWO_CALLS) == FINISHED
    assert run_grammar(tokenizer, grammar, "Sunny, I think.", eos=False) == REJECTED
    assert run_grammar(tokenizer, grammar, CALL.replace('"Paris"', "7"), eos=False) == REJECTED  # schema
    assert run_grammar(tokenizer, grammar, CALL.replace(':{"', ': {"'), eos=False) == REJECTED  # compact JSON
    assert run_grammar(tokenizer, grammar, CALL.replace("get_weather", "get_news"), eos=False) == REJECTED
    assert run_grammar(tokenizer, grammar, CALL[:-3]) == REJECTED  # EOS before the call closes


def test_one_call_without_parallel_calls_or_for_a_named_function(tokenizer):
    single = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_plan.grammar()
    assert run_grammar(tokenizer, single, CALL, eos=False) == FINISHED  # nothing may follow
    assert run_grammar(tokenizer, single, TWO_CALLS, eos=False) == REJECTED
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert run_grammar(tokenizer, named.tool_plan.grammar(), CALL, eos=False) == REJECTED
    assert run_grammar(tokenizer, named.tool_plan.grammar(), TWO_CALLS.split("\n", 3)[3], eos=False) == FINISHED


def test_auto_grammar_takes_text_or_calls_never_a_broken_call(tokenizer):
    grammar = chat(tools=[WEATHER]).tool_plan.grammar()
    assert run_grammar(tokenizer, grammar, "It is sunny in <b>Paris</b>.") == FINISHED
    assert run_grammar(tokenizer, grammar, CALL) == FINISHED
    assert run_grammar(tokenizer, grammar, "<tool_call>\nsunny", eos=False) == REJECTED
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    json_text = chat(tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert run_grammar(tokenizer, json_text.tool_plan.grammar(schema), '{"answer":"sunny"}') == FINISHED
    assert run_grammar(tokenizer, json_text.tool_plan.grammar(schema), "sunny", eos=False) == REJECTED
    assert run_grammar(tokenizer, json_text.tool_plan.grammar(schema), CALL, eos=False) == OK


@pytest.mark.parametrize("text", [TWO_CALLS, CALL.replace("Paris", 'Pa}\\"\\nris')])
def test_parser_gives_the_same_calls_at_every_split(text):
    plan = chat(tools=[WEATHER, TIME], tool_choice="required").tool_plan
    whole, parser = parse_reply(plan, text)
    assert whole.content == "" and parser.finish_reason("stop") == "tool_calls"
    expected = [(c.index, c.name, c.arguments) for c in whole.calls]
    assert [json.loads(a) for _, _, a in expected][0]["city"] in ("Paris", 'Pa}"\nris')
    for cut in range(1, len(text)):
        stream = ReplyParser(plan)
        got = stream.feed(text[:cut])
        got.add(stream.feed(text[cut:]))
        got.add(stream.close())
        assert [(c.index, c.name, c.arguments) for c in got.calls] == expected, cut
        assert got.content == "" and len({c.id for c in got.calls}) == len(expected)


def test_parser_streams_arguments_as_they_come_and_text_at_once():
    plan = chat(tools=[WEATHER]).tool_plan
    stream = ReplyParser(plan)
    assert stream.feed("<tool").content == ""  # may still open a call
    opening = stream.feed('_call>\n{"name":"get_weather","arguments":{"ci')
    assert [(c.index, c.name, c.arguments) for c in opening.calls] == [(0, "get_weather", '{"ci')]
    assert opening.calls[0].to_openai()["type"] == "function"
    more = stream.feed('ty":"Paris"}}\n</tool')  # the envelope's end is held back
    assert [(c.index, c.id, c.arguments) for c in more.calls] == [(0, None, 'ty":"Paris"}')]
    assert more.calls[0].to_openai() == {"index": 0, "function": {"arguments": 'ty":"Paris"}'}}
    text = ReplyParser(plan)
    assert text.feed("<b>Sun").content == "<b>Sun" and text.feed("ny</b>").content == "ny</b>"
    assert text.finish_reason("stop") == "stop"


def test_parser_cut_short():
    plan = chat(tools=[WEATHER], tool_choice="required").tool_plan
    reply, parser = parse_reply(plan, CALL[:-8])  # the closing tag cut: the arguments are whole
    assert [c.arguments for c in reply.calls] == ['{"city":"Paris"}'] and parser.finish_reason("length") == "length"
    reply, parser = parse_reply(plan, CALL[:52])  # the arguments cut: no call is shown as made
    assert reply.calls == [] and reply.content == "" and parser.completed == 0
    assert parser.finish_reason("length") == "length"
    reply, parser = parse_reply(plan, TWO_CALLS[:-20])  # the first call whole, the second cut
    assert [(c.index, c.name, c.arguments) for c in reply.calls] == [(0, "get_weather", '{"city":"Paris"}')]
    stream = ReplyParser(plan)  # streamed, the cut arguments went out as they came; the finish reason says so
    streamed = stream.feed(CALL[:52])
    streamed.add(stream.close())
    assert [c.arguments for c in streamed.calls] == ['{"city'] and stream.finish_reason("length") == "length"
    reply, parser = parse_reply(plan, CALL[:40])  # not even the name: no call, and no content either
    assert reply.calls == [] and reply.content == "" and parser.cut == 0
    reply, parser = parse_reply(chat(tools=[WEATHER]).tool_plan, "<tool_")  # under auto: text that may open a call
    assert reply.calls == [] and reply.content == "<tool_" and parser.cut is None
