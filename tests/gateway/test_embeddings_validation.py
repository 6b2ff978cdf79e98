"""/v1/embeddings request validation: OpenAI's input forms, and the clear refusals (services.gateway.embeddings)."""

from __future__ import annotations

import pytest

from common.config import Embeddings, Limits
from common.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST
from services.gateway.embeddings import EmbeddingRequest, check_dimensions, input_refusal
from services.gateway.openai_api import Refused
from services.gateway.protocol import ErrorMsg, GatewayError
from services.gateway.validation import Context, validate

CTX = Context(limits=Limits(), served_model_name="tiny", embeddings=Embeddings(pooling="mean", max_inputs=3))


def refusal(data) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        validate(EmbeddingRequest, data, CTX)
    assert caught.value.code == INVALID_REQUEST
    return caught.value


@pytest.mark.parametrize(
    ("given", "forms"),
    [
        ("hi", [("hi", None)]),
        (["a", "b"], [("a", None), ("b", None)]),
        ([1, 2], [(None, [1, 2])]),
        ([[1, 2], [3]], [(None, [1, 2]), (None, [3])]),
    ],
)
def test_input_forms_become_prefill_only_requests(given, forms):
    parsed = validate(EmbeddingRequest, {"model": "tiny", "input": given, "user": "ignored"}, CTX)
    requests = parsed.to_requests(CTX)
    assert [(r.prompt, r.prompt_ids) for r in requests] == forms
    assert all(r.max_tokens == 0 and r.pooling == "mean" for r in requests)
    assert parsed.encoding_format == "float"


def test_cache_salt_and_priority_go_to_every_input():
    parsed = validate(EmbeddingRequest, {"input": ["a", "b"], "cache_salt": "s", "priority": 3}, CTX)
    assert {(r.cache_salt, r.priority) for r in parsed.to_requests(CTX)} == {("s", 3)}


@pytest.mark.parametrize(
    ("data", "param", "fragment"),
    [
        ({}, "input", "Field required"),
        ({"input": ""}, "input", "the input must be a non-empty string"),
        ({"input": []}, "input", "must be a non-empty string"),
        ({"input": ["a", ""]}, "input", "input 1 must be a non-empty string"),
        ({"input": [[1], []]}, "input", "input 1 must be a non-empty string"),
        ({"input": [1.5]}, "input", "list of token ids"),
        ({"input": [True]}, "input", "list of token ids"),
        ({"input": {"text": "a"}}, "input", "must be a non-empty string"),
        ({"input": ["a", "b", "c", "d"]}, "input", "at most 3 inputs"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "a", "dimensions": "8"}, "dimensions", "valid integer"),
        ({"input": "a", "cache_salt": ""}, "cache_salt", "at least 1 character"),
    ],
)
def test_refusals_name_the_field(data, param, fragment):
    error = refusal(data)
    assert error.param == param and fragment in error.message, error.message


def test_dimensions_only_as_the_model_has_them():
    check_dimensions(None, 576)
    check_dimensions(576, 576)
    with pytest.raises(GatewayError) as caught:
        check_dimensions(256, 576)
    assert caught.value.param == "dimensions" and "model's 576 dimensions" in caught.value.message
    assert "(got 256)" in caught.value.message
    with pytest.raises(GatewayError, match="not known yet"):
        check_dimensions(256, 0)


def test_a_too_long_input_is_named():
    error = ErrorMsg(code=CONTEXT_LENGTH_EXCEEDED, message="the prompt has 3000 tokens; ...", recoverable=True,
                     recovery_action="reduce_prompt", param="prompt")
    named = input_refusal(Refused(2, error), inputs=3)
    assert (named.param, named.message) == ("input", "input 2: the prompt has 3000 tokens; ...")
    assert input_refusal(Refused(0, error), inputs=1).message.startswith("input: the prompt has")
    other = ErrorMsg(code="rate_limited", message="slow down", recoverable=True, recovery_action="retry")
    assert input_refusal(Refused(1, other), inputs=3) is other
