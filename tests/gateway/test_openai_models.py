"""OpenAI request validation: the accepted forms, vLLM defaults, and clear refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.config import Limits
from common.errors import INVALID_REQUEST
from services.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from services.gateway.protocol import GatewayError
from services.gateway.validation import Context, validate

CTX = Context(limits=Limits(max_top_logprobs=5, max_choices=6), served_model_name="tiny")


def refusal(model, data) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        validate(model, data, CTX)
    assert caught.value.code == INVALID_REQUEST
    return caught.value


@pytest.mark.parametrize(
    ("prompt", "forms"),
    [
        ("hi", [("hi", None)]),
        (["hi"], [("hi", None)]),
        ([1, 2], [(None, [1, 2])]),
        ([[1, 2]], [(None, [1, 2])]),
        (["a", "b"], [("a", None), ("b", None)]),
        ([[1], [2, 3]], [(None, [1]), (None, [2, 3])]),
        (["a", [4]], [("a", None), (None, [4])]),
    ],
)
def test_completion_prompt_forms(prompt, forms):
    requests = validate(CompletionRequest, {"model": "tiny", "prompt": prompt}, CTX).to_requests(CTX)
    assert [(r.prompt, r.prompt_ids) for r in requests] == forms


def test_n_choices_per_prompt_with_derived_seeds():
    data = {"prompt": ["a", "b"], "n": 3, "seed": 2**63 - 2, "temperature": 0.5}
    requests = validate(CompletionRequest, data, CTX).to_requests(CTX)
    assert [r.prompt for r in requests] == ["a"] * 3 + ["b"] * 3
    assert [r.seed for r in requests] == [2**63 - 2, 2**63 - 1, -(2**63)] * 2  # as vLLM: seed + i, wrapped
    assert {r.temperature for r in requests} == {0.5}
    unseeded = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "n": 2}, CTX)
    assert [r.seed for r in unseeded.to_requests(CTX)] == [None, None]


def test_defaults_like_vllm():
    (request,) = validate(CompletionRequest, {"prompt": "x", "user": "someone", "top_k": -1}, CTX).to_requests(CTX)
    assert (request.temperature, request.top_p, request.top_k, request.max_tokens, request.top_logprobs) == (
        1.0,
        1.0,
        0,
        None,
        None,
    )
    # max_tokens: 16 for completions; for chat limits.default_max_tokens (the driver's fallback), or the setting
    assert request.default_max_tokens == 16
    (chat,) = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, CTX).to_requests(CTX)
    assert (chat.max_tokens, chat.default_max_tokens) == (None, None)
    capped = Context(limits=Limits(chat_default_max_tokens=50), served_model_name="tiny")
    (chat,) = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}, capped).to_requests(capped)
    assert chat.default_max_tokens == 50


@pytest.mark.parametrize(
    ("data", "param", "fragment"),
    [
        ({"prompt": ["a", ""]}, "prompt", "prompt 1 must be a non-empty string"),
        ({"prompt": ""}, "prompt", "the prompt must be a non-empty string"),
        ({"prompt": []}, "prompt", "must be a non-empty string"),
        ({"prompt": [1.5]}, "prompt", "list of token ids"),
        ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "x", "n": 7}, "n", "at most 6"),
        ({"prompt": ["a", "b"], "n": 4}, None, "2 prompts x n=4 make more than 6 choices"),
        ({"prompt": "x", "best_of": 3}, "best_of", "not supported by this server; use n"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 4}, None, "min_tokens (5) must be at most max_tokens (4)"),
        ({"prompt": "x", "logit_bias": {"a": 5}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias.1", "less than or equal to 100"),
        ({"prompt": "x", "min_p": 1.1}, "min_p", "less than or equal to 1"),
        ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 token ids"),
        ({"prompt": "x", "stop_token_ids": list(range(301))}, "stop_token_ids", "at most 300 token ids"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than or equal to 0"),
        ({"prompt": "x", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "valid boolean"),
        ({"prompt": "x", "skip_special_tokens": 0}, "skip_special_tokens", "valid boolean"),
        ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json", "constrained output is not enabled"),
        ({"prompt": "x", "logprobs": 6}, "logprobs", "at most 5"),
        ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"prompt": "x", "top_p": float("nan")}, "top_p", "finite number"),
        ({"prompt": "x", "seed": -(2**63) - 1}, "seed", "greater than or equal to"),
    ],
)
def test_completion_refusals(data, param, fragment):
    error = refusal(CompletionRequest, data)
    assert error.param == param and fragment in error.message


def test_neutral_values_of_unsupported_fields_pass():
    data = {"prompt": "x", "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1,
            "skip_special_tokens": True, "min_tokens": 0, "metadata": {"a": "b"}}
    assert len(validate(CompletionRequest, data, CTX).to_requests(CTX)) == 1


def test_echo_with_logprobs_asks_for_the_prompt_logprobs():
    (scored,) = validate(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 1}, CTX).to_requests(CTX)
    assert scored.prompt_logprobs and scored.top_logprobs == 1
    for data in ({"prompt": "x", "echo": True}, {"prompt": "x", "logprobs": 1}):
        (request,) = validate(CompletionRequest, data, CTX).to_requests(CTX)
        assert not request.prompt_logprobs


def test_chat_request():
    data = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi", "name": "bob"}],
        "max_completion_tokens": 7,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": "\n",
    }
    (request,) = validate(ChatCompletionRequest, data, CTX).to_requests(CTX)
    assert request.messages == [{"role": "user", "content": "hi"}]
    assert (request.max_tokens, request.top_logprobs, request.stop) == (7, 2, ("\n",))
    (plain,) = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}, CTX).to_requests(CTX)
    assert plain.top_logprobs is None


def test_chat_refusals():
    assert refusal(ChatCompletionRequest, {"messages": []}).param == "messages"
    assert (
        "needs logprobs"
        in refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).message
    )
    chat = {"messages": [{"role": "user", "content": "x"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert refusal(ChatCompletionRequest, {**chat, "n": 7}).param == "n"
    assert refusal(ChatCompletionRequest, {**chat, "tools": [tool]}).param == "tools"
    assert refusal(ChatCompletionRequest, {**chat, "tool_choice": "required"}).param == "tool_choice"
    assert "add_generation_prompt false" in refusal(ChatCompletionRequest, {**chat, "continue_final_message": True}).message
    open_end = {**chat, "continue_final_message": True, "add_generation_prompt": False}
    assert "the assistant's" in refusal(ChatCompletionRequest, open_end).message
    prefilled = {"messages": [*chat["messages"], {"role": "assistant", "content": "Sure"}],
                 "continue_final_message": True, "add_generation_prompt": False}
    (request,) = validate(ChatCompletionRequest, prefilled, CTX).to_requests(CTX)
    assert (request.continue_final_message, request.add_generation_prompt) == (True, False)
    assert validate(ChatCompletionRequest, {**chat, "tools": [], "tool_choice": "none"}, CTX).to_requests(CTX)
    json_object = {**chat, "response_format": {"type": "json_object"}}
    assert "JSON output is not enabled" in refusal(ChatCompletionRequest, json_object).message  # CTX has no controller
    assert refusal(ChatCompletionRequest, {**chat, "response_format": {"type": "json_schema"}}).param == "response_format"


def test_json_response_format_runs_under_the_json_controller():
    ctx = dataclasses.replace(CTX, json_controller="native:json")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    data = {"messages": [{"role": "user", "content": "x"}], "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    requests = validate(ChatCompletionRequest, data, ctx).to_requests(ctx)
    assert {r.controller for r in requests} == {"native:json"}
    assert json.loads(requests[0].controller_arg) == {"json_schema": schema, "max_tokens": CTX.limits.max_tokens_cap}
    (obj,) = validate(CompletionRequest, {"prompt": "x", "response_format": {"type": "json_object"}}, ctx).to_requests(ctx)
    assert json.loads(obj.controller_arg)["json_schema"] == {"type": "object"}
    (text,) = validate(CompletionRequest, {"prompt": "x", "response_format": {"type": "text"}}, CTX).to_requests(CTX)
    assert text.controller is None


def test_stream_options_need_a_stream():
    error = refusal(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}})
    assert "stream_options" in str(error) and "stream" in str(error)
    ok = validate(CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}, CTX)
    assert ok.stream_options.include_usage


def test_penalties_min_tokens_and_logit_bias_reach_the_sampling():
    data = {"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.25, "min_tokens": 3, "max_tokens": 8,
            "logit_bias": {"7": -100, "42": 2.5}, "min_p": 0.1}
    (request,) = validate(CompletionRequest, data, CTX).to_requests(CTX)
    sampling = request.sampling()
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.min_tokens) == (0.5, -0.25, 3)
    assert sampling.logit_bias == {7: -100.0, 42: 2.5} and sampling.min_p == 0.1
    json_format = {"messages": [{"role": "user", "content": "x"}], "min_tokens": 2,
                   "response_format": {"type": "json_object"}}
    with pytest.raises(GatewayError, match="min_tokens cannot hold back"):
        validate(ChatCompletionRequest, json_format, dataclasses.replace(CTX, json_controller="native:json"))


def test_null_fields_take_their_defaults():
    """vLLM's request fields are Optional (``n``, ``stream``, ``echo``, ``logprobs``, ``parallel_tool_calls``, ...):
    clients that fill every field send null for those they leave, and get the defaults, not a 400."""
    nulls = dict.fromkeys(["n", "stream", "stream_options", "ignore_eos", "stop", "seed", "temperature", "max_tokens"])
    (completion,) = validate(CompletionRequest, {"prompt": "x", "echo": None, "logprobs": None, **nulls},
                             CTX).to_requests(CTX)
    assert (completion.echo, completion.top_logprobs, completion.ignore_eos, completion.temperature) == (
        False, None, False, 1.0)
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": None, "top_logprobs": None,
            "parallel_tool_calls": None, "tools": None, "tool_choice": None, "add_generation_prompt": None,
            "continue_final_message": None, "max_completion_tokens": None, **nulls}
    parsed = validate(ChatCompletionRequest, chat, CTX)
    (request,) = parsed.to_requests(CTX)
    assert (parsed.n, parsed.stream, parsed.parallel_tool_calls) == (1, False, True)
    assert (request.top_logprobs, request.add_generation_prompt, request.continue_final_message) == (None, True, False)
    assert refusal(ChatCompletionRequest, {**chat, "messages": None}).param == "messages"  # still required


def test_chat_template_kwargs_reach_the_rendering():
    """vLLM's chat_template_kwargs (e.g. ``enable_thinking``, which agent frameworks send to every server) are the
    template's variables; what the request's own fields set (messages, tools, add_generation_prompt, ...) and what
    transformers takes for itself (tokenize, chat_template) are refused, not silently overridden."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    (request,) = validate(ChatCompletionRequest, {**chat, "chat_template_kwargs": {"enable_thinking": False}},
                          CTX).to_requests(CTX)
    assert request.chat_template_kwargs == {"enable_thinking": False}
    (empty,) = validate(ChatCompletionRequest, {**chat, "chat_template_kwargs": {}}, CTX).to_requests(CTX)
    assert empty.chat_template_kwargs is None
    for key in ("tools", "add_generation_prompt", "chat_template", "tokenize", "messages"):
        error = refusal(ChatCompletionRequest, {**chat, "chat_template_kwargs": {key: 1}})
        assert error.param == "chat_template_kwargs" and repr(key) in error.message
    assert refusal(ChatCompletionRequest, {**chat, "chat_template_kwargs": ["x"]}).param == "chat_template_kwargs"


def test_reserved_template_kwargs_cover_what_transformers_takes_itself():
    import inspect

    from transformers import PreTrainedTokenizerBase

    from services.gateway.validation import RESERVED_TEMPLATE_KWARGS

    named = {p.name for p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    assert named <= RESERVED_TEMPLATE_KWARGS


@pytest.mark.parametrize(
    ("fields", "constraint"),
    [
        ({"structured_outputs": {"json": {"type": "object"}}}, {"json_schema": {"type": "object"}}),
        ({"structured_outputs": {"json": '{"type": "integer"}'}}, {"json_schema": '{"type": "integer"}'}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"structured_outputs": {"choice": ["yes", "no way"]}}, {"regex": "(yes|no way)"}),
        ({"structured_outputs": {"json_object": True}}, {"json_schema": {"type": "object"}}),
        ({"guided_json": {"type": "array"}}, {"json_schema": {"type": "array"}}),
        ({"guided_regex": "a|b", "guided_decoding_backend": "xgrammar"}, {"regex": "a|b"}),
        ({"guided_choice": ["a.b", "(c)"]}, {"regex": "(a\\x{2e}b|\\x{28}c\\x{29})"}),
    ],
)
def test_structured_outputs_and_guided_fields_run_under_the_json_controller(fields, constraint):
    """vLLM's structured_outputs (and the guided_* fields of vLLM before 0.12) constrain the output on the JSON
    controller (llguidance), as a JSON response_format does; a choice is a regex whose characters are literals."""
    ctx = dataclasses.replace(CTX, json_controller="native:json")
    for data in ({"prompt": "x", **fields}, {"messages": [{"role": "user", "content": "x"}], **fields}):
        model = CompletionRequest if "prompt" in data else ChatCompletionRequest
        (request,) = validate(model, data, ctx).to_requests(ctx)
        assert request.controller == "native:json"
        assert json.loads(request.controller_arg) == {**constraint, "max_tokens": CTX.limits.max_tokens_cap}


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of 'json', 'regex', 'choice'"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got ['regex', 'choice']"),
        ({"structured_outputs": {"grammar": "root ::= \"a\""}}, "structured_outputs.grammar", "give a regex"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown field"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1 item"),
        ({"guided_json": {}, "guided_regex": "a"}, None, "not guided_json and guided_regex"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, None,
         "not response_format and guided_regex"),
        ({"guided_grammar": "start: \"a\""}, "guided_grammar", "not supported"),
        ({"guided_choice": ["a"], "min_tokens": 2}, None, "min_tokens cannot hold back"),
    ],
)
def test_output_constraint_refusals(fields, param, fragment):
    ctx = dataclasses.replace(CTX, json_controller="native:json")
    with pytest.raises(GatewayError) as caught:
        validate(CompletionRequest, {"prompt": "x", **fields}, ctx)
    assert caught.value.param == param and fragment in caught.value.message, caught.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with_tools = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "guided_regex": "a"}
    with pytest.raises(GatewayError, match="not with tools"):
        validate(ChatCompletionRequest, with_tools, ctx)
    (left_out,) = validate(ChatCompletionRequest, {**with_tools, "tool_choice": "none"}, ctx).to_requests(ctx)
    assert json.loads(left_out.controller_arg)["regex"] == "a"


def test_priority_orders_the_request_as_vllm_priority_scheduling():
    """vLLM's ``priority`` (lower runs first) becomes the request's place in the scheduler's order (accepted and
    ignored before); it must be an integer."""
    (request,) = validate(CompletionRequest, {"prompt": "x", "priority": -3}, CTX).to_requests(CTX)
    assert request.priority == -3
    (default,) = validate(CompletionRequest, {"prompt": "x"}, CTX).to_requests(CTX)
    assert default.priority == 0
    assert refusal(CompletionRequest, {"prompt": "x", "priority": "high"}).param == "priority"
