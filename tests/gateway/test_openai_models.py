"""OpenAI request validation: the accepted forms, vLLM defaults, and clear refusals."""

from __future__ import annotations

import pytest

from common.config import Limits
from common.errors import INVALID_REQUEST
from services.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from services.gateway.protocol import GatewayError
from services.gateway.validation import Context, validate

CTX = Context(limits=Limits(max_top_logprobs=5), served_model_name="tiny")


def refusal(model, data) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        validate(model, data, CTX)
    assert caught.value.code == INVALID_REQUEST
    return caught.value


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [("hi", "hi", None), (["hi"], "hi", None), ([1, 2], None, [1, 2]), ([[1, 2]], None, [1, 2])],
)
def test_completion_prompt_forms(prompt, text, ids):
    request = validate(CompletionRequest, {"model": "tiny", "prompt": prompt}, CTX).to_request()
    assert (request.prompt, request.prompt_ids) == (text, ids)


def test_defaults_like_vllm():
    request = validate(CompletionRequest, {"prompt": "x", "user": "someone", "top_k": -1}, CTX).to_request()
    assert (request.temperature, request.top_p, request.top_k, request.max_tokens, request.top_logprobs) == (
        1.0,
        1.0,
        0,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("data", "param", "fragment"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "only one prompt"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": [1.5]}, "prompt", "list of token ids"),
        ({"prompt": "x", "n": 2}, "n", "only n=1"),
        ({"prompt": "x", "best_of": 3}, "best_of", "only best_of=1"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "repetition_penalty"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({"prompt": "x", "logprobs": 6}, "logprobs", "at most 5"),
        ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ],
)
def test_completion_refusals(data, param, fragment):
    error = refusal(CompletionRequest, data)
    assert error.param == param and fragment in error.message


def test_echo_with_logprobs_is_refused():
    assert "prompt logprobs" in refusal(CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 1}).message


def test_chat_request():
    data = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi", "name": "bob"}],
        "max_completion_tokens": 7,
        "logprobs": True,
        "top_logprobs": 2,
        "stop": "\n",
    }
    request = validate(ChatCompletionRequest, data, CTX).to_request()
    assert request.messages == [{"role": "user", "content": "hi"}]
    assert (request.max_tokens, request.top_logprobs, request.stop) == (7, 2, ("\n",))
    plain = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}, CTX).to_request()
    assert plain.top_logprobs is None


def test_chat_refusals():
    assert refusal(ChatCompletionRequest, {"messages": []}).param == "messages"
    assert (
        "needs logprobs"
        in refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}).message
    )
    assert refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "n": 3}).param == "n"
