"""The OpenAI-compatible API through the official ``openai`` client, on the real stack."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
import torch

from tests.gateway.support import parse_sse

MAX_TOKENS = 10
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


def chat_ids(stack) -> list[int]:
    text = stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return stack.tokenizer(text, add_special_tokens=False).input_ids


def test_models(stack, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [stack.settings.served_model_name]
    assert client.models.retrieve(stack.settings.served_model_name) == models.data[0]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found"


def test_streaming_chat_matches_transformers(stack, client, hf_greedy):
    prompt = chat_ids(stack)
    expected = hf_greedy(prompt, MAX_TOKENS)
    stream = client.chat.completions.create(
        model=stack.settings.served_model_name,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == stack.tokenizer.decode(expected, skip_special_tokens=True)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop" if expected[-1] == stack.tokenizer.eos_token_id else "length"]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt)
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_chat_with_logprobs(stack, client, hf_greedy):
    expected = hf_greedy(chat_ids(stack), 4)
    reply = client.chat.completions.create(
        model=stack.settings.served_model_name,
        messages=MESSAGES,
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == stack.tokenizer.decode(expected, skip_special_tokens=True)
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [stack.tokenizer.decode([t]) for t in expected]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
    assert entries[0].bytes == list(entries[0].token.encode())
    assert reply.usage.completion_tokens == 4


def test_completion_with_logprobs_and_stop(stack, client, hf_greedy):
    expected = hf_greedy(stack.tokenizer(PROMPT).input_ids, MAX_TOKENS)
    reply = client.completions.create(
        model=stack.settings.served_model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
    )
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert choice.text == stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.logprobs.tokens == [stack.tokenizer.decode([t]) for t in expected]
    assert choice.logprobs.text_offset[1] == len(choice.logprobs.tokens[0])
    assert all(len(top) == 1 for top in choice.logprobs.top_logprobs)  # the greedy token is the favourite
    sampled = client.completions.create(
        model=stack.settings.served_model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=2.0, seed=7, logprobs=0
    ).choices[0].logprobs  # logprobs 0: each token's own logprob only (vLLM)
    assert sampled.top_logprobs == [{t: lp} for t, lp in zip(sampled.tokens, sampled.token_logprobs, strict=True)]

    stopped = client.completions.create(
        model=stack.settings.served_model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop="."
    )
    assert stopped.choices[0].text == " Paris" and stopped.choices[0].finish_reason == "stop"


def test_a_completion_without_max_tokens_gets_16_as_from_vllm(stack, client):
    reply = client.completions.create(model=stack.settings.served_model_name, prompt=PROMPT, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (16, "length")


def test_stop_token_ids_end_the_completion(stack, client, hf_greedy):
    """vLLM's ``stop_token_ids``: the first greedy token among them ends the choice with "stop";
    it counts as a completion token, and its text is not in the output."""
    expected = hf_greedy(stack.tokenizer(PROMPT).input_ids, MAX_TOKENS)
    stop_at = next(i for i in range(2, MAX_TOKENS) if expected[i] not in expected[:i])  # its first occurrence
    reply = client.completions.create(
        model=stack.settings.served_model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"stop_token_ids": [expected[stop_at], 10**9]},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == stack.tokenizer.decode(expected[:stop_at], skip_special_tokens=True)
    assert reply.usage.completion_tokens == stop_at + 1


def test_usage_reports_prompt_tokens_from_the_prefix_cache(stack, client):
    """The same long prompt twice: the second reuses the first's full KV blocks, and says so as vLLM does."""
    prompt = f"Note {uuid.uuid4().hex}: " + "the lighthouse keeper climbed the stairs and lit the lamp. " * 4
    ask = dict(model=stack.settings.served_model_name, prompt=prompt, max_tokens=2, temperature=0)
    first, second = client.completions.create(**ask), client.completions.create(**ask)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0  # whole blocks, never the last token

    def streamed_chat_usage():
        stream = client.chat.completions.create(model=stack.settings.served_model_name, max_tokens=1, stream=True,
                                                messages=[{"role": "user", "content": prompt}],
                                                stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None]
        assert len(usage) == 1
        return usage[0]

    # the chat template's opening may be cached from other chats; the second time the whole message is too
    first_chat, second_chat = streamed_chat_usage(), streamed_chat_usage()
    assert first_chat.prompt_tokens_details.cached_tokens < second_chat.prompt_tokens_details.cached_tokens


def test_streaming_completion_with_echo_and_token_prompt(stack, client, hf_greedy):
    ids = stack.tokenizer(PROMPT).input_ids
    expected = hf_greedy(ids, 4)
    stream = client.completions.create(
        model=stack.settings.served_model_name, prompt=ids, max_tokens=4, temperature=0, echo=True, stream=True
    )
    text = "".join(c.choices[0].text for c in stream)
    assert text == PROMPT + stack.tokenizer.decode(expected, skip_special_tokens=True)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(stack, client, hf_model, hf_greedy):
    """lm-eval's loglikelihood request (token prompts in a batch, echo, logprobs=1, max_tokens=1):
    every prompt token but the first gets its logprob under transformers' own forward pass, with the
    model's favourite among its alternatives, then the generated token follows; streamed alike."""
    prompts = [stack.tokenizer(PROMPT).input_ids, stack.tokenizer("def fibonacci(n):").input_ids]
    ask = dict(model=stack.settings.served_model_name, prompt=prompts, max_tokens=1, temperature=0, logprobs=1,
               echo=True, seed=1234)
    reply = client.completions.create(**ask)
    streamed = list(client.completions.create(**ask, stream=True))
    for ids, choice in zip(prompts, sorted(reply.choices, key=lambda c: c.index), strict=True):
        with torch.inference_mode():
            expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        logprobs = choice.logprobs
        generated = hf_greedy(ids, 1)
        assert logprobs.tokens == [stack.tokenizer.decode([t]) for t in ids + generated]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        want = [expected[p - 1, ids[p]].item() for p in range(1, len(ids))] + [expected[-1, generated[0]].item()]
        assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
        for p, top in enumerate(logprobs.top_logprobs[1:], start=1):  # the token itself, then the favourite
            favourite = int(expected[p - 1].argmax())
            token = logprobs.tokens[p]
            assert list(top) == list(dict.fromkeys([token, stack.tokenizer.decode([favourite])]))
            assert top[token] == logprobs.token_logprobs[p]
        assert any(len(top) == 2 for top in logprobs.top_logprobs[1:])  # some prompt token is not the favourite
        assert logprobs.text_offset[1] == len(logprobs.tokens[0])
        assert choice.text == stack.tokenizer.decode(ids + generated)
        parts = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert sum((part.logprobs.tokens for part in parts if part.logprobs), []) == logprobs.tokens
        streamed_logprobs = sum((part.logprobs.token_logprobs for part in parts if part.logprobs), [])
        assert streamed_logprobs[0] is None
        assert streamed_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-4)


def test_errors_raise_the_matching_exceptions(stack, client):
    model = stack.settings.served_model_name
    with pytest.raises(openai.BadRequestError, match="must be at most") as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, n=stack.settings.limits.max_choices + 1)
    assert caught.value.body["param"] == "n" and caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=" hi" * 3000)
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "narrator", "content": "x"}])
    assert caught.value.body["param"] == "messages[0].role"


def test_raw_error_body_and_sse_done(stack):
    with httpx.Client(base_url=stack.http_url) as http:
        reply = http.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
        assert reply.status_code == 400
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
        reply = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    events = parse_sse(reply.text)
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_batch_prompts_with_n_choices(stack, client, hf_greedy):
    """A batch of prompts (text and token ids), n choices each: choice k*n + i is prompt k's, each prompt's tokens
    counted once in the usage (as vLLM does)."""
    prompts = [PROMPT, stack.tokenizer("def fibonacci(n):").input_ids]
    ids = [stack.tokenizer(PROMPT).input_ids, prompts[1]]
    greedy = [hf_greedy(p, 6) for p in ids]
    expected = [stack.tokenizer.decode(g, skip_special_tokens=True) for g in greedy]
    ask = dict(model=stack.settings.served_model_name, prompt=prompts, n=2, max_tokens=6, temperature=0)
    reply = client.completions.create(**ask)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [expected[0]] * 2 + [expected[1]] * 2
    assert reply.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert reply.usage.completion_tokens == 2 * (len(greedy[0]) + len(greedy[1]))

    chunks = list(client.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["" for _ in range(4)], [[] for _ in range(4)]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    assert texts == [c.text for c in reply.choices] and finishes == [[c.finish_reason] for c in reply.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_n_seeded_choices_are_the_seeds_of_single_requests(stack, client):
    """Choice i of a seeded request samples as a single request seeded seed + i (vLLM's parallel sampling).
    top_k keeps the draws clear of the float noise between batch shapes, which can move a draw over a flat tail."""
    ask = dict(
        model=stack.settings.served_model_name,
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        max_tokens=8,
        temperature=1.0,
        extra_body={"top_k": 5},
    )
    reply = client.chat.completions.create(**ask, n=3, seed=1234)
    texts = [c.message.content for c in reply.choices]
    singles = [client.chat.completions.create(**ask, seed=1234 + i).choices[0].message.content for i in range(3)]
    assert texts == singles and len(set(texts)) > 1

    stream = client.chat.completions.create(**ask, n=3, seed=1234, stream=True)
    streamed, roles = ["", "", ""], []
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            roles += [choice.index] if choice.delta.role else []
    assert streamed == texts and sorted(roles) == [0, 1, 2]


def test_response_format_json_schema_and_json_object(stack, client):
    """JSON output runs under the JSON controller: a schema's output validates, streamed or not."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "maximum": 9}},
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    ask = dict(
        model=stack.settings.served_model_name,
        messages=[{"role": "user", "content": "Pick a color and a count, as JSON."}],
        max_tokens=30,
        temperature=0,
    )
    json_schema = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    reply = client.chat.completions.create(**ask, response_format=json_schema)
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(**ask, stream=True, response_format=json_schema)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == reply.choices[0].message.content

    obj = client.chat.completions.create(**ask, response_format={"type": "json_object"})
    content = obj.choices[0].message.content
    assert content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    text = dict(ask, max_tokens=4)
    plain = client.chat.completions.create(**text, response_format={"type": "text"})
    assert plain.choices[0].message.content == client.chat.completions.create(**text).choices[0].message.content


def test_unsupported_fields_are_refused_not_ignored(stack, client):
    model = stack.settings.served_model_name
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    refusals = [
        (dict(extra_body={"functions": [tool["function"]]}), "functions"),  # the deprecated form of tools
        (dict(tool_choice="required"), "tool_choice"),  # without tools
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(extra_body={"min_p": 1.2}), "min_p"),
        (dict(response_format={"type": "json_schema"}), "response_format"),
    ]
    for kwargs, param in refusals:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **kwargs)
        assert caught.value.body["param"] == param, caught.value.body
    limit = stack.settings.limits.max_choices
    with pytest.raises(openai.BadRequestError, match=f"more than {limit} choices"):
        client.completions.create(model=model, prompt=["a", "b"], n=limit, max_tokens=1)
    # neutral values of the same fields change nothing and pass
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, temperature=0, frequency_penalty=0, tool_choice="none", user="u"
    )
    assert reply.choices[0].finish_reason == "length"


def test_tokenize_counts_what_generation_feeds(stack, client):
    """vLLM's /tokenize: a prompt and chat messages become the very ids a completion or a chat
    request feeds (its usage says as much), and /detokenize turns ids back into text."""
    model = stack.settings.served_model_name
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        prompt = http.post("/tokenize", json={"model": model, "prompt": PROMPT, "return_token_strs": True}).json()
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        back = http.post("/detokenize", json={"model": model, "tokens": prompt["tokens"]}).json()
        # lm-eval's remote tokenizer: /tokenizer_info, then /tokenize with add_special_tokens false
        info = http.get("/tokenizer_info").json()
        plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        refusals = [
            (http.post("/tokenize", json={"prompt": PROMPT, "messages": MESSAGES}), 400, "either 'prompt' or 'messages'"),
            (http.post("/tokenize", json={"messages": MESSAGES, "continue_final_message": True}), 400,
             "continue_final_message"),
            (http.post("/detokenize", json={"tokens": [10**9]}), 400, "outside the vocabulary"),
            (http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens"),
            (http.post("/tokenize", json={"model": "gpt-4o", "prompt": "x"}), 404, "gpt-4o"),
        ]
    assert prompt["tokens"] == stack.tokenizer(PROMPT).input_ids and prompt["count"] == len(prompt["tokens"])
    assert prompt["token_strs"] == stack.tokenizer.convert_ids_to_tokens(prompt["tokens"])
    assert prompt["max_model_len"] == stack.settings.limits.max_model_len
    assert chat["tokens"] == chat_ids(stack) and chat["token_strs"] is None
    assert back == {"prompt": PROMPT}
    assert plain["tokens"] == stack.tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert (info["eos_token"], info["chat_template"]) == (stack.tokenizer.eos_token, stack.tokenizer.chat_template)
    usage = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"]
    for response, status, fragment in refusals:
        assert response.status_code == status and fragment in response.json()["error"]["message"], response.text


def greedy_adjusted(hf_model, ids: list[int], n: int, adjust) -> list[int]:
    """transformers' greedy decoding with ``adjust(logits, generated)`` applied to each step's logits
    (the oracle for penalties and min_tokens), stopping after an EOS."""
    generated: list[int] = []
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    with torch.inference_mode():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids + generated])).logits[0, -1].float()
            generated.append(int(adjust(logits, generated).argmax()))
            if generated[-1] in eos:
                break
    return generated


def test_presence_and_frequency_penalties_follow_openai(stack, client, hf_model):
    """OpenAI's penalties on greedy decoding: each step's logits drop by frequency_penalty per earlier
    occurrence of a token in the output and presence_penalty once, as the oracle applies them."""
    ids = stack.tokenizer("one, one, one, one, one,").input_ids
    penalties = dict(frequency_penalty=1.5, presence_penalty=0.5)

    def adjust(logits, generated):
        for token in set(generated):
            logits[token] -= generated.count(token) * penalties["frequency_penalty"] + penalties["presence_penalty"]
        return logits

    expected = greedy_adjusted(hf_model, ids, 8, adjust)
    plain = greedy_adjusted(hf_model, ids, 8, lambda logits, _: logits)
    assert expected != plain  # the penalties change what greedy picks here
    reply = client.completions.create(model=stack.settings.served_model_name, prompt=ids, max_tokens=8, temperature=0,
                                      logprobs=0, **penalties)
    assert reply.choices[0].text == stack.tokenizer.decode(expected, skip_special_tokens=True)


def test_min_tokens_holds_back_the_end(stack, client, hf_model, hf_greedy):
    messages = [{"role": "user", "content": "Reply with one word: is the sky blue?"}]
    text = stack.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = stack.tokenizer(text, add_special_tokens=False).input_ids
    natural = hf_greedy(ids, 24)
    eos = stack.tokenizer.eos_token_id
    assert natural[-1] == eos and len(natural) < 12  # greedy ends early here
    floor = len(natural) + 3

    def adjust(logits, generated):
        if len(generated) < floor:
            logits[eos] = float("-inf")
        return logits

    expected = greedy_adjusted(hf_model, ids, 24, adjust)
    reply = client.chat.completions.create(model=stack.settings.served_model_name, messages=messages, max_tokens=24,
                                           temperature=0, extra_body={"min_tokens": floor})
    assert reply.usage.completion_tokens == len(expected) >= floor
    assert reply.choices[0].message.content == stack.tokenizer.decode(expected, skip_special_tokens=True)


def test_logit_bias_steers_greedy_as_openai_defines(stack, client, hf_model, hf_greedy):
    ids = stack.tokenizer(PROMPT).input_ids
    favourite = hf_greedy(ids, 1)[0]
    bias = {favourite: -100.0, stack.tokenizer(" London").input_ids[0]: 8.0}

    def adjust(logits, _generated):
        for token, value in bias.items():
            logits[token] += value
        return logits

    expected = greedy_adjusted(hf_model, ids, 6, adjust)
    assert expected[0] != favourite
    model = stack.settings.served_model_name
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                      logit_bias={str(t): v for t, v in bias.items()})
    assert reply.choices[0].text == stack.tokenizer.decode(expected, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary") as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, logit_bias={"99999999": 1})
    assert caught.value.body["param"] == "logit_bias"


def test_min_p_of_one_keeps_only_the_favourite(stack, client, hf_greedy):
    """vLLM's min_p: at 1.0 only the most likely token survives, so sampling at any temperature is greedy."""
    ids = stack.tokenizer(PROMPT).input_ids
    reply = client.completions.create(model=stack.settings.served_model_name, prompt=PROMPT, max_tokens=8,
                                      temperature=1.5, seed=3, extra_body={"min_p": 1.0})
    assert reply.choices[0].text == stack.tokenizer.decode(hf_greedy(ids, 8), skip_special_tokens=True)


def test_chat_continues_a_prefilled_assistant_message(stack, client, hf_greedy):
    """vLLM's continue_final_message: the last (assistant) message is left open and the model goes
    on from its last word, as transformers renders it; /tokenize renders it the same way."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Red, green and"}]
    rendering = dict(add_generation_prompt=False, continue_final_message=True)
    text = stack.tokenizer.apply_chat_template(messages, tokenize=False, **rendering)
    ids = stack.tokenizer(text, add_special_tokens=False).input_ids
    expected = hf_greedy(ids, 6)
    reply = client.chat.completions.create(model=stack.settings.served_model_name, messages=messages, max_tokens=6,
                                           temperature=0, extra_body=rendering)
    assert reply.choices[0].message.content == stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(ids)
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        tokens = http.post("/tokenize", json={"messages": messages, **rendering}).json()["tokens"]
        plain = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert tokens == ids
    without = stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert plain == stack.tokenizer(without, add_special_tokens=False).input_ids
