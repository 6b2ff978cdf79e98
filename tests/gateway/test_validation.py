"""Request validation: every bad field is refused with invalid_request and a message naming it."""

from __future__ import annotations

import pytest

from common.config import Limits, Settings
from common.errors import INVALID_REQUEST
from common.wire import SamplingPatch
from services.gateway.protocol import GatewayError
from services.gateway.validation import (
    DEFAULT_TOP_LOGPROBS,
    Context,
    ControlMessage,
    FeedbackMessage,
    GenerateConfig,
    ParametersPatch,
    flat_body_to_config,
    parse_client_message,
    validate,
)

CTX = Context(limits=Limits(max_tokens_cap=100, max_stop_strings=2, max_top_logprobs=5), served_model_name="tiny")


def refusal(model, data, **kwargs) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        validate(model, data, CTX, **kwargs)
    assert caught.value.code == INVALID_REQUEST
    return caught.value


def test_minimal_config_gets_defaults():
    config = validate(GenerateConfig, {"prompt": "hi"}, CTX)
    request = config.to_request()
    assert (request.prompt, request.max_tokens, request.temperature, request.top_p, request.top_k) == (
        "hi",
        None,
        1.0,
        1.0,
        0,
    )
    assert config.options.stream and not config.options.echo_prompt and request.top_logprobs is None


@pytest.mark.parametrize(
    ("data", "param", "fragment"),
    [
        ({"prompt": "x", "parameters": {"temperature": -0.1}}, "parameters.temperature", "greater than or equal to 0"),
        ({"prompt": "x", "parameters": {"top_p": 0}}, "parameters.top_p", "greater than 0"),
        ({"prompt": "x", "parameters": {"top_p": 1.5}}, "parameters.top_p", "less than or equal to 1"),
        ({"prompt": "x", "parameters": {"top_k": -1}}, "parameters.top_k", "greater than or equal to 0"),
        ({"prompt": "x", "parameters": {"max_tokens": 0}}, "parameters.max_tokens", "greater than or equal to 1"),
        ({"prompt": "x", "parameters": {"max_tokens": 101}}, "parameters.max_tokens", "at most 100"),
        ({"prompt": "x", "parameters": {"max_tokens": 2.5}}, "parameters.max_tokens", "valid integer"),
        ({"prompt": "x", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty", "greater than 0"),
        ({"prompt": "x", "parameters": {"stop": ["a", "b", "c"]}}, "parameters.stop", "at most 2 stop strings"),
        ({"prompt": "x", "parameters": {"stop": [""]}}, "parameters.stop[0]", "at least 1 character"),
        ({"prompt": "x", "parameters": {"temperature": "hot"}}, "parameters.temperature", "valid number"),
        ({"prompt": "x", "parameters": {"temperature": float("inf")}}, "parameters.temperature", "finite number"),
        ({"prompt": "x", "parameters": {"seed": 2**64}}, "parameters.seed", "less than or equal to"),
        ({"prompt": "x", "parameters": {"top_k": 2**64}}, "parameters.top_k", "less than or equal to"),
        ({"prompt": "x", "parameters": {"temprature": 1}}, "parameters.temprature", "unknown field"),
        ({"prompt": "x", "parameters": []}, "parameters", "JSON object"),
        ({"prompt": 42}, "prompt", "valid string"),
        ({"prompt": ""}, "prompt", "at least 1 character"),
        ({"prompt": "x", "model": "other"}, "model", "not served here"),
        ({"prompt": "x", "options": {"stream": "yes"}}, "options.stream", "valid boolean"),
        ({"prompt": "x", "options": {"include_logprobs": 6}}, "options.include_logprobs", "at most 5"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "only text"),
        ({"messages": []}, "messages", "at least 1 item"),
    ],
)
def test_bad_config_names_the_field(data, param, fragment):
    error = refusal(GenerateConfig, data)
    assert error.param == param
    assert error.message.startswith(f"{param}: ") and fragment in error.message


def test_prompt_and_messages_are_exclusive():
    assert "exactly one of" in refusal(GenerateConfig, {}).message
    assert (
        "exactly one of"
        in refusal(GenerateConfig, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}).message
    )


def test_every_error_is_reported():
    error = refusal(GenerateConfig, {"prompt": "x", "parameters": {"temperature": -1, "top_k": -1}})
    assert "parameters.temperature" in error.message and "parameters.top_k" in error.message


def test_stop_string_and_logprobs_flag_forms():
    config = validate(
        GenerateConfig, {"prompt": "x", "parameters": {"stop": "\n"}, "options": {"include_logprobs": True}}, CTX
    )
    assert config.to_request().stop == ("\n",)
    assert config.to_request().top_logprobs == DEFAULT_TOP_LOGPROBS == 5
    assert (
        validate(GenerateConfig, {"prompt": "x", "options": {"include_logprobs": False}}, CTX).to_request().top_logprobs
        is None
    )
    assert (
        validate(GenerateConfig, {"prompt": "x", "options": {"include_logprobs": 2}}, CTX).to_request().top_logprobs
        == 2
    )


def test_chat_content_parts_are_joined():
    data = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert validate(GenerateConfig, data, CTX).to_request().messages == [{"role": "user", "content": "ab"}]


def test_patch_validates_like_config_and_applies():
    patch = validate(ParametersPatch, {"temperature": 0.5, "stop": "x"}, CTX, prefix="parameters")
    assert patch.to_patch() == SamplingPatch(temperature=0.5, stop=["x"])
    request = validate(GenerateConfig, {"prompt": "p", "parameters": {"max_tokens": 9}}, CTX).to_request()
    patched = request.patched(patch.to_patch())
    assert (patched.temperature, patched.stop, patched.max_tokens, patched.prompt) == (0.5, ("x",), 9, "p")
    assert refusal(ParametersPatch, {"top_p": 2}, prefix="parameters").param == "parameters.top_p"
    assert "at least one parameter" in refusal(ParametersPatch, {}, prefix="parameters").message


def test_control_and_feedback_messages():
    assert validate(ControlMessage, {"action": "stop"}, CTX).action == "stop"
    assert "'stop', 'pause', 'resume', 'regenerate' or 'modify'" in refusal(ControlMessage, {"action": "jump"}).message
    assert "needs a 'parameters'" in refusal(ControlMessage, {"action": "modify"}).message
    assert "only allowed with action 'modify'" in refusal(ControlMessage, {"action": "stop", "parameters": {}}).message
    assert validate(FeedbackMessage, {"rating": -1, "text": "meh", "position": 3}, CTX).rating == -1
    assert refusal(FeedbackMessage, {"rating": 1.5}).param == "rating"
    assert refusal(FeedbackMessage, {"rating": True}).param == "rating"
    assert refusal(FeedbackMessage, {"rating": 0, "position": -1}).param == "position"
    assert refusal(FeedbackMessage, {"rating": 0, "position": 2**64}).param == "position"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, not list"),
        ('"config"', "must be a JSON object, not str"),
        ('{"prompt": "x"}', "no 'type' field"),
        ('{"type": "generate"}', "unknown message type 'generate'"),
        ('{"type": 7}', "unknown message type 7"),
        ('{"type": "config", "x": ' + "[" * 65 + "]" * 65 + "}", "deeper than 64 levels (limits.max_json_depth)"),
        ("[" * 5000 + "]" * 5000, "deeper than 64 levels"),  # past what Python's parser recurses into
        ('{"type": "stop", "s": "' + "[" * 100 + '"}', "unknown message type 'stop'"),  # brackets in a string
    ],
)
def test_bad_frames(raw, fragment):
    with pytest.raises(GatewayError) as caught:
        parse_client_message(raw, Limits().max_json_depth)
    assert caught.value.code == INVALID_REQUEST and fragment in caught.value.message


def test_flat_rest_body_folds_into_config():
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "stream": False, "parameters": {"top_k": 2}}
    assert flat_body_to_config(body) == {
        "prompt": "x",
        "parameters": {"top_k": 2, "max_tokens": 3, "temperature": 0},
        "options": {"stream": False},
    }
    with pytest.raises(GatewayError, match="max_tokens: given both"):
        flat_body_to_config({"prompt": "x", "max_tokens": 3, "parameters": {"max_tokens": 4}})
    message = {"type": "config", "prompt": "x", "parameters": {"max_tokens": 5}}  # a WebSocket config message as is
    assert flat_body_to_config(message) == {"prompt": "x", "parameters": {"max_tokens": 5}}


def test_null_takes_the_default_and_unknown_fields_stay_refused():
    config = validate(GenerateConfig, {"prompt": "hi", "model": None, "options": None,
                                       "parameters": {"stop": None, "max_tokens": None, "temperature": None}}, CTX)
    assert config == validate(GenerateConfig, {"prompt": "hi"}, CTX)
    assert refusal(GenerateConfig, {"prompt": "hi", "colour": None}).message == "colour: unknown field"
    assert "give exactly one of 'prompt'" in refusal(GenerateConfig, {"prompt": None, "messages": None}).message


def test_context_from_settings():
    settings = Settings(served_model_name="m")
    assert Context.of(settings) == Context(settings.limits, "m", json_controller="native:constrained")
    for name in ("", "absent"):  # JSON output is off, or names no configured native controller
        settings = Settings(served_model_name="m", controllers={"response_format": name})
        assert Context.of(settings).json_controller is None
