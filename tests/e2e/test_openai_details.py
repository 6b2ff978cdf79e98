"""OpenAI details users hit: ``max_tokens: 0`` with ``echo`` scores the prompt without generating,
every refused request is counted in ``requests_total``, and a too large ``max_tokens`` names the
context."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import websockets

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


def test_max_tokens_zero_with_echo_scores_the_prompt_only(stack, client):
    model = stack.settings.served_model_name
    ids = stack.tokenizer(PROMPT).input_ids
    scored = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == stack.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    # the same positions as a one-token generation's prompt part
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=2, temperature=0)
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:-1]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(one.choices[0].logprobs.token_logprobs[1:-1], abs=1e-4)
    streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert [c.choices[0].finish_reason for c in streamed if c.choices[0].finish_reason] == ["length"]
    with pytest.raises(openai.BadRequestError, match="needs echo"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)


def test_max_tokens_past_the_cap_names_the_context(stack, client):
    limits = stack.settings.limits
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=stack.settings.served_model_name, prompt=PROMPT,
                                  max_tokens=limits.max_tokens_cap + 1)
    message = caught.value.body["message"]
    assert f"at most {limits.max_tokens_cap}" in message and f"context of {limits.max_model_len} tokens" in message


def refused(metrics: str, surface: str) -> float:
    pattern = rf'^tiller:requests_total\{{outcome="invalid_request",surface="{surface}"\}} (\S+)$'
    found = re.search(pattern, metrics, re.M)
    return float(found.group(1)) if found else 0.0


async def test_every_refused_request_is_counted(stack):
    """One refusal per surface (before any generation starts); each counts once, under its surface."""
    import grpc

    from common.protos.salience.v1 import salience_pb2 as pb
    from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc

    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        before = (await http.get("/metrics")).text
        bad = {"model": stack.settings.served_model_name, "prompt": PROMPT, "temperature": -1}
        assert (await http.post("/v1/completions", json=bad)).status_code == 400
        assert (await http.post("/v1/chat/completions", content=b"{not json")).status_code == 400
        assert (await http.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 0})).status_code == 400
        async with websockets.connect(stack.ws_url) as ws:
            await ws.send(json.dumps({"type": "config", "prompt": PROMPT, "parameters": {"top_p": 2}}))
            assert json.loads(await ws.recv())["type"] == "error"
            await ws.send(json.dumps({"type": "control", "action": "stop"}))  # no request: not counted
            assert json.loads(await ws.recv())["type"] == "error"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pb_grpc.SalienceStub(channel).OpenSession(pb.OpenSessionRequest(model="gpt-4o"))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = (await http.get("/metrics")).text
    counts = {s: refused(after, s) - refused(before, s) for s in ("openai", "rest", "websocket", "salience")}
    assert counts == {"openai": 2, "rest": 1, "websocket": 1, "salience": 1}


@pytest.mark.parametrize(("route", "body"), [("completions", {"prompt": PROMPT}),
                                             ("chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})])
def test_streams_read_as_vllm_bench_serve_reads_them(stack, route, body):
    """``vllm bench serve``'s OpenAI backends: ``data: `` lines of JSON, every chunk with choices until a last one
    with ``usage`` and no choices (``stream_options.include_usage``), then ``data: [DONE]``; with ``ignore_eos``
    the usage counts exactly ``max_tokens``."""
    payload = {"model": stack.settings.served_model_name, **body, "max_tokens": 12, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=stack.http_url, timeout=120) as http:
        with http.stream("POST", f"/v1/{route}", json=payload) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    *deltas, last = chunks
    assert all(c["choices"] and c.get("usage") is None for c in deltas)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    assert last["usage"]["prompt_tokens"] > 0
    texts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "" for c in deltas]
    assert "".join(texts).strip()


def test_continuous_usage_stats_count_each_choices_tokens_so_far(stack, client):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries its choice's
    usage so far (the prompt's tokens, the tokens generated up to that chunk), then the usual last chunk with the
    response's total. A token whose text is held back (a possible stop string) still counts."""
    model = stack.settings.served_model_name
    prompt_tokens = len(stack.tokenizer(PROMPT).input_ids)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=0,
                                            n=2, stop=["\n\nThe answer"], stream=True, stream_options=options))
    *deltas, last = chunks
    seen = [0, 0]
    for chunk in deltas:
        (choice,) = chunk.choices
        seen[choice.index] += len(choice.logprobs.tokens) if choice.logprobs else 0
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (prompt_tokens, seen[choice.index])
        assert chunk.usage.total_tokens == prompt_tokens + seen[choice.index]
    assert last.choices == [] and last.usage.completion_tokens == sum(seen) and last.usage.prompt_tokens == prompt_tokens
    assert "".join(c.choices[0].text for c in deltas if c.choices[0].index == 0) == " Paris."  # the stop string held

    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=4, temperature=0, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    assert [c.usage.completion_tokens for c in chat] == [0, 1, 2, 3, 4, 4, 4]  # role, 4 tokens, finish, total
    plain = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True, True, True, False]  # without it: the last chunk only


def test_chat_template_kwargs_are_accepted_as_vllm_accepts_them(stack, client):
    """Agent frameworks send vLLM's ``chat_template_kwargs`` (``enable_thinking: false``) to every server: a variable
    the model's template does not read changes nothing (SmolLM2's reads none), in the reply and in /tokenize."""
    ask = dict(model=stack.settings.served_model_name, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
               temperature=0)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    plain, thinking_off = client.chat.completions.create(**ask), client.chat.completions.create(**ask, extra_body=kwargs)
    assert thinking_off.choices[0].message.content == plain.choices[0].message.content
    assert thinking_off.usage.prompt_tokens == plain.usage.prompt_tokens
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        counted = http.post("/tokenize", json={"messages": ask["messages"], **kwargs}).json()
    assert counted["count"] == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert caught.value.body["param"] == "chat_template_kwargs"


def test_structured_outputs_and_guided_fields_constrain_the_output(stack, client):
    """vLLM's ``structured_outputs`` (``choice``, ``regex``, ``json``) and the ``guided_*`` fields of vLLM before 0.12
    (which now ignores them: unconstrained output): the output follows the constraint, sampled or not, streamed alike."""
    import jsonschema

    model = stack.settings.served_model_name
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    choices = ["yes", "no", "It's (maybe) 50.5%"]
    cases = [
        ({"structured_outputs": {"choice": choices}}, lambda text: text in choices),
        ({"guided_choice": choices}, lambda text: text in choices),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
        ({"guided_regex": "(red|green) [a-z]{1,8}"}, lambda text: re.fullmatch("(red|green) [a-z]{1,8}", text)),
        ({"structured_outputs": {"json": schema}}, lambda text: jsonschema.validate(json.loads(text), schema) is None),
        ({"guided_json": schema}, lambda text: jsonschema.validate(json.loads(text), schema) is None),
    ]
    for extra, follows in cases:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=30, temperature=0.8, seed=5,
                                               extra_body=extra)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop" and follows(text), (extra, text)
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=30, temperature=0.8, seed=5,
                                                extra_body=extra, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
        completion = client.completions.create(model=model, prompt="Q: Is the sky blue?\nA:", max_tokens=30,
                                               temperature=0, extra_body=extra)
        assert completion.choices[0].finish_reason == "stop" and follows(completion.choices[0].text), (extra, completion)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert caught.value.body["param"] == "structured_outputs"


def test_stop_reason_and_include_stop_str_in_output_as_vllm(stack, client):
    """vLLM's ``stop_reason`` on each choice: the stop string or the requested stop token id that ended it, None
    where the length (or the model's EOS) did; ``include_stop_str_in_output`` keeps the stop string in the text,
    sent whole and streamed alike."""
    model = stack.settings.served_model_name
    common = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    full = client.completions.create(**common, logprobs=0).choices[0]
    assert full.finish_reason == "length" and full.model_extra["stop_reason"] is None
    stop = "\n\nThe"
    assert stop in full.text
    cut = client.completions.create(**common, stop=[stop]).choices[0]
    assert (cut.text, cut.finish_reason, cut.model_extra["stop_reason"]) == (full.text.split(stop)[0], "stop", stop)
    kept_text = full.text[: full.text.index(stop) + len(stop)]
    kept = client.completions.create(**common, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert (kept.choices[0].text, kept.choices[0].model_extra["stop_reason"]) == (kept_text, stop)
    chunks = list(client.completions.create(**common, stop=[stop], stream=True,
                                            extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in chunks) == kept_text
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks][-1:] == [stop]
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=12, temperature=0, stop=[" "], stream=True,
                                               extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chat).endswith(" ")
    assert chat[-1].choices[0].finish_reason == "stop" and chat[-1].choices[0].model_extra["stop_reason"] == " "

    second = full.logprobs.tokens[1]  # the second token generated: ended at, its text left out
    (token_id,) = stack.tokenizer(second, add_special_tokens=False).input_ids
    by_token = client.completions.create(**common, extra_body={"stop_token_ids": [token_id]}).choices[0]
    assert (by_token.text, by_token.finish_reason) == (full.logprobs.tokens[0], "stop")
    assert by_token.model_extra["stop_reason"] == token_id


def test_skip_special_tokens_false_shows_their_text(stack, client):
    """vLLM's ``skip_special_tokens: false``: special tokens generated past an ignored EOS show as their text
    (``<|im_end|>``, ...), sent whole and streamed alike, where by default they have none."""
    model = stack.settings.served_model_name
    common = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40,
              "temperature": 0}
    plain = client.chat.completions.create(**common, extra_body={"ignore_eos": True}).choices[0].message.content
    shown = client.chat.completions.create(
        **common, extra_body={"ignore_eos": True, "skip_special_tokens": False}).choices[0].message.content
    specials = [t for t in stack.tokenizer.all_special_tokens if t in shown]
    assert "<|im_end|>" in specials
    for special in specials:
        shown = shown.replace(special, "")
    assert shown == plain
    streamed = client.chat.completions.create(
        **common, stream=True, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert "<|im_end|>" in "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
