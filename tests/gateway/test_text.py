"""Prompt handling with the real tokenizer of the default model: chat template, ids, filter."""

from __future__ import annotations

import pytest

from common.config import Settings
from common.errors import INVALID_REQUEST
from common.model_source import load_tokenizer
from services.gateway.protocol import GatewayError
from services.gateway.text import TextProcessor
from services.gateway.validation import GenerationRequest

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Settings())


@pytest.fixture
async def text(tokenizer):
    processor = TextProcessor(tokenizer, ["(?i)forbidden", r"\bsecret\b"])
    yield processor
    processor.close()


async def test_plain_prompt(text, tokenizer):
    prompt_text, ids = await text.prompt(GenerationRequest(prompt="Hello world"))
    assert prompt_text == "Hello world" and ids == tokenizer("Hello world").input_ids


async def test_chat_prompt_uses_the_template(text, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt_text, ids = await text.prompt(GenerationRequest(messages=messages))
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt_text == expected and prompt_text.endswith("<|im_start|>assistant\n")
    assert ids == tokenizer(expected, add_special_tokens=False).input_ids


async def test_token_id_prompt(text, tokenizer):
    ids = tokenizer("Hello world").input_ids
    assert await text.prompt(GenerationRequest(prompt_ids=ids)) == ("Hello world", ids)
    with pytest.raises(GatewayError) as caught:
        await text.prompt(GenerationRequest(prompt_ids=[1, len(tokenizer)]))
    assert caught.value.code == INVALID_REQUEST and "outside the vocabulary" in caught.value.message


async def test_token_texts(text, tokenizer):
    await text.load_token_texts()
    token_id = tokenizer(" the").input_ids[0]
    assert text.token_text(token_id) == " the"
    assert text.token_text(-1) == "" and text.token_text(len(tokenizer)) == ""


async def test_content_filter(text):
    assert text.refused("something FORBIDDEN here")
    assert text.refused("a secret.") and not text.refused("secretary")
    assert not text.refused("all good")


async def test_chat_template_kwargs_are_the_templates_variables(tokenizer):
    """vLLM's chat_template_kwargs reach the template as variables (a reasoning model's ``enable_thinking``); one
    the template does not read changes nothing; a value the template cannot use is the client's error."""
    import copy

    thinking = copy.copy(tokenizer)
    thinking.chat_template = tokenizer.chat_template + "{% if enable_thinking %}<think>{% endif %}{{ 1 + effort }}"
    processor = TextProcessor(thinking, [])
    messages = [{"role": "user", "content": "Hi"}]
    try:
        on, _ = await processor.prompt(GenerationRequest(messages=messages,
                                                         chat_template_kwargs={"enable_thinking": True, "effort": 2}))
        off, _ = await processor.prompt(GenerationRequest(messages=messages,
                                                          chat_template_kwargs={"enable_thinking": False, "effort": 2}))
        assert on.endswith("<|im_start|>assistant\n<think>3") and off.endswith("<|im_start|>assistant\n3")
        with pytest.raises(GatewayError) as caught:
            await processor.prompt(GenerationRequest(messages=messages, chat_template_kwargs={"effort": "high"}))
        assert caught.value.param == "chat_template_kwargs" and "TypeError" in caught.value.message
    finally:
        processor.close()
    plain = GenerationRequest(messages=messages)
    unread = GenerationRequest(messages=messages, chat_template_kwargs={"enable_thinking": False})
    assert (await text_of(tokenizer, unread)) == (await text_of(tokenizer, plain))


async def text_of(tokenizer, request: GenerationRequest) -> tuple[str, list[int]]:
    processor = TextProcessor(tokenizer, [])
    try:
        return await processor.prompt(request)
    finally:
        processor.close()


async def test_the_content_filter_sees_the_template_variables_texts():
    request = GenerationRequest(messages=[{"role": "user", "content": "Hi"}],
                                chat_template_kwargs={"persona": {"name": "Secret agent", "tags": ["x", 3]}})
    assert request.written_text("<rendered>").split("\n") == ["Hi", "persona", "name", "Secret agent", "tags", "x"]
    assert GenerationRequest(prompt="p").written_text("p") == "p"
