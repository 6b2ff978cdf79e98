"""The WebSocket protocol end to end, on the real stack, checked against transformers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

from tests.gateway.support import (
    collect,
    generate,
    greedy_config,
    kinds,
    receive,
    scheduler_idle,
    send,
    token_ids,
    wait_for,
    ws_generate,
)

MAX_TOKENS = 10
ORACLE_TOKENS = 32  # the token-for-token comparison with transformers runs longer
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the color of the sky?"}]


def prompt_ids(stack, *, prompt: str | None = None, messages: list[dict[str, str]] | None = None) -> list[int]:
    if messages is not None:
        text = stack.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return stack.tokenizer(text, add_special_tokens=False).input_ids
    return stack.tokenizer(prompt).input_ids


def check_stream(stack, messages, expected_ids: list[int], n_prompt: int, *, echo: str = "") -> None:
    """A complete, consistent stream: init, one token message per expected token, completion."""
    assert kinds(messages) == ["init"] + ["token"] * len(expected_ids) + ["completion"], messages
    init, tokens, completion = messages[0], messages[1:-1], messages[-1]
    assert init["request_id"].startswith("gen_") and init["model"] == stack.settings.served_model_name
    assert init["model_info"]["max_tokens"] == stack.settings.limits.max_model_len
    assert token_ids(messages) == expected_ids
    text = echo
    for message in tokens:
        text += message["token"]
        assert message["generated_text"] == text
    assert [m["finished"] for m in tokens] == [False] * (len(tokens) - 1) + [True]
    assert tokens[-1]["finish_reason"] == completion["finish_reason"]
    expected_text = stack.tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert completion["generated_text"] == echo + expected_text
    eos = expected_ids[-1] in (stack.tokenizer.eos_token_id,)
    assert completion["finish_reason"] == ("stop" if eos else "length")
    assert completion["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": len(expected_ids),
        "total_tokens": n_prompt + len(expected_ids),
    }
    assert completion["request_id"] == init["request_id"]


@pytest.mark.parametrize(
    "case", [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}, {"messages": CHAT}], ids=["text", "code", "chat"]
)
async def test_greedy_matches_transformers(stack, hf_greedy, case):
    ids = prompt_ids(stack, **case)
    expected = hf_greedy(ids, ORACLE_TOKENS)
    messages = await ws_generate(stack.ws_url, greedy_config(**case, max_tokens=ORACLE_TOKENS))
    check_stream(stack, messages, expected, len(ids))


async def test_ignore_eos_generates_past_eos(stack, hf_greedy):
    chat = [{"role": "user", "content": "Reply with one word: hello"}]
    ids = prompt_ids(stack, messages=chat)
    natural = hf_greedy(ids, 64)
    assert natural[-1] == stack.tokenizer.eos_token_id, "precondition: this prompt ends with EOS by itself"
    config = greedy_config(messages=chat, max_tokens=len(natural) + 5)
    config["parameters"]["ignore_eos"] = True
    messages = await ws_generate(stack.ws_url, config)
    assert token_ids(messages)[: len(natural)] == natural
    assert messages[-1]["finish_reason"] == "length"
    assert messages[-1]["usage"]["completion_tokens"] == len(natural) + 5


async def test_eight_concurrent_streams(stack, hf_greedy):
    prompts = [
        f"{subject} is" for subject in ("Water", "The sun", "A cat", "Music", "Python", "The moon", "Bread", "Winter")
    ]
    expected = [hf_greedy(prompt_ids(stack, prompt=p), MAX_TOKENS) for p in prompts]
    results = await asyncio.gather(
        *(ws_generate(stack.ws_url, greedy_config(prompt=p, max_tokens=MAX_TOKENS)) for p in prompts)
    )
    for prompt, messages, ids in zip(prompts, results, expected, strict=True):
        check_stream(stack, messages, ids, len(prompt_ids(stack, prompt=prompt)))
    assert len({m[0]["request_id"] for m in results}) == len(prompts)


async def test_options_echo_logprobs_timing(stack, hf_greedy):
    prompt = PROMPTS[0]
    ids = prompt_ids(stack, prompt=prompt)
    expected = hf_greedy(ids, MAX_TOKENS)
    config = greedy_config(
        prompt=prompt, max_tokens=MAX_TOKENS, echo_prompt=True, include_logprobs=2, include_timing=True
    )
    messages = await ws_generate(stack.ws_url, config)
    check_stream(stack, messages, expected, len(ids), echo=prompt)
    total = 0.0
    for message in messages[1:-1]:
        sampled, *alternatives = message["logprobs"]
        assert sampled["token"] == stack.tokenizer.decode([message["token_id"]])
        assert len(alternatives) == 2 and all(entry["logprob"] <= 0 for entry in message["logprobs"])
        assert sampled["token"] not in [entry["token"] for entry in alternatives]  # tokens besides the chosen one
        # greedy: the sampled token is the most likely, the alternatives the next two
        assert sampled["logprob"] >= alternatives[0]["logprob"] >= alternatives[1]["logprob"]
        assert message["timing"]["token_ms"] >= 0 and message["timing"]["total_ms"] >= total
        total = message["timing"]["total_ms"]
    timing = messages[-1]["timing"]
    assert 0 < timing["first_token_ms"] <= timing["total_ms"]


async def test_without_token_options_the_token_message_is_minimal(stack):
    messages = await ws_generate(
        stack.ws_url, {"prompt": PROMPTS[0], "parameters": {"max_tokens": 2, "temperature": 0}}
    )
    assert set(messages[1]) == {"type", "token", "generated_text", "finish_reason", "finished"}
    assert "timing" not in messages[-1]


async def test_non_streaming_sends_init_then_completion(stack, hf_greedy):
    ids = prompt_ids(stack, prompt=PROMPTS[1])
    expected = hf_greedy(ids, MAX_TOKENS)
    config = greedy_config(prompt=PROMPTS[1], max_tokens=MAX_TOKENS, stream=False, include_logprobs=1)
    messages = await ws_generate(stack.ws_url, config)
    assert kinds(messages) == ["init", "completion"]
    completion = messages[1]
    assert completion["token_ids"] == expected
    assert completion["generated_text"] == stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert [len(entries) for entries in completion["logprobs"]] == [2] * len(expected)


async def test_stop_string(stack):
    messages = await ws_generate(
        stack.ws_url, {"prompt": PROMPTS[0], "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0, "stop": ["."]}}
    )
    completion = messages[-1]
    assert completion["finish_reason"] == "stop" and completion["generated_text"] == " Paris"


# -- control actions ------------------------------------------------------------------------------


async def test_stop_ends_with_a_cancelled_completion(stack):
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", "prompt": PROMPTS[0], "parameters": {"max_tokens": 500, "ignore_eos": True}})
        assert (await receive(ws))["type"] == "init"
        assert (await receive(ws))["type"] == "token"
        await send(ws, {"type": "control", "action": "stop"})
        messages = await collect(ws)
        completion = messages[-1]
        assert completion["type"] == "completion" and completion["finish_reason"] == "cancelled"
        assert completion["usage"]["completion_tokens"] < 500
        assert completion["generated_text"].startswith("".join(m["token"] for m in messages if m["type"] == "token"))
        # the recovery flow: the connection takes a new config
        assert kinds(await generate(ws, {"prompt": "Hi", "parameters": {"max_tokens": 2}}))[-1] == "completion"
    await wait_for(lambda: scheduler_idle(stack), 10, "the scheduler to free the stopped sequence")


async def test_pause_holds_the_sequence_and_resume_continues_it(stack, hf_greedy):
    ids = prompt_ids(stack, prompt=PROMPTS[1])
    expected = hf_greedy(ids, MAX_TOKENS)
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", **greedy_config(prompt=PROMPTS[1], max_tokens=MAX_TOKENS)})
        messages = [await receive(ws), await receive(ws)]
        await send(ws, {"type": "control", "action": "pause"})
        while (message := await receive(ws))["type"] != "status":
            messages.append(message)  # a token of the step already under way
        assert message == {
            "type": "status",
            "operation": "pause",
            "progress": 100,
            "message": "generation paused",
            "request_id": messages[0]["request_id"],
        }
        # silence after the acknowledgement (the tokens of steps already under way are held until the resume)
        with pytest.raises(asyncio.TimeoutError):
            late = await receive(ws, timeout=1.0)
            pytest.fail(f"a message after the pause was acknowledged: {late}")
        health = await asyncio.to_thread(stack.scheduler_health)
        assert health["paused"] == 1
        await send(ws, {"type": "control", "action": "resume"})
        ack = await receive(ws)
        assert ack["operation"] == "resume" and ack["message"] == "generation resumed"
        messages += await collect(ws)
    check_stream(stack, messages, expected, len(ids))


async def test_controls_sent_right_after_the_config_act_on_its_generation(stack, hf_greedy):
    """A client cannot know when the generation starts but by its init: controls and feedback sent at once
    wait the moment it takes to start, and then act on it."""
    ids = prompt_ids(stack, prompt=PROMPTS[0])
    expected = hf_greedy(ids, 4)
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", **greedy_config(prompt=PROMPTS[0], max_tokens=200)})
        await send(ws, {"type": "control", "action": "modify", "parameters": {"max_tokens": 4}})
        await send(ws, {"type": "control", "action": "pause"})
        await send(ws, {"type": "feedback", "rating": 1})
        seen = []
        with pytest.raises(asyncio.TimeoutError):
            while True:
                seen.append(await receive(ws, timeout=1.5))
        statuses = [m for m in seen if m["type"] == "status"]
        assert [s["operation"] for s in statuses] == ["modify", "pause", "feedback"], seen
        paused_at = seen.index(statuses[1])
        assert "token" not in kinds(seen[paused_at:]) and "completion" not in kinds(seen)
        await send(ws, {"type": "control", "action": "resume"})
        assert (await receive(ws))["operation"] == "resume"
        rest = await collect(ws)
    check_stream(stack, [m for m in seen if m["type"] != "status"] + rest, expected, len(ids))


async def test_modify_applies_mid_stream(stack, hf_greedy):
    ids = prompt_ids(stack, prompt=PROMPTS[0])
    expected = hf_greedy(ids, 5)
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", **greedy_config(prompt=PROMPTS[0], max_tokens=200)})
        messages = [await receive(ws), await receive(ws)]
        await send(ws, {"type": "control", "action": "modify", "parameters": {"temperature": -1}})
        await send(ws, {"type": "control", "action": "modify", "parameters": {"max_tokens": 5, "top_k": 1}})
        acks = []
        while True:
            message = await receive(ws)
            if message["type"] in ("status", "error"):
                acks.append(message)
            else:
                messages.append(message)
            if message["type"] == "completion":
                break
    refused, ack = acks
    assert refused["error"] == "invalid_request" and refused["request_id"] is None
    assert refused["message"].startswith("parameters.temperature:")
    assert ack == {
        "type": "status",
        "operation": "modify",
        "progress": 100,
        "message": "parameters updated",
        "request_id": messages[0]["request_id"],
        "parameters": {"max_tokens": 5, "top_k": 1},
    }
    check_stream(stack, messages, expected, len(ids))


async def test_stop_strings_given_mid_stream_end_the_text_where_they_complete(stack, hf_greedy):
    """The gateway works out a request's text until a modify gives it stop strings; the scheduler then
    takes it over (common.event_text): the text goes on without a seam and ends before the stop string."""
    ids = prompt_ids(stack, prompt=PROMPTS[1])
    expected = hf_greedy(ids, ORACLE_TOKENS)
    full = stack.tokenizer.decode(expected, skip_special_tokens=True)
    cut = next(k for k in range(len(full) * 2 // 3, len(full) - 4) if full.find(full[k : k + 4]) == k
               and full[k : k + 4].strip())
    stop = full[cut : cut + 4]  # first seen late in the text: after the modify lands
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", **greedy_config(prompt=PROMPTS[1], max_tokens=ORACLE_TOKENS)})
        messages = [await receive(ws), await receive(ws)]
        assert messages[1]["type"] == "token"
        await send(ws, {"type": "control", "action": "modify", "parameters": {"stop": [stop]}})
        acks = []
        while True:
            message = await receive(ws)
            (acks if message["type"] == "status" else messages).append(message)
            if message["type"] == "completion":
                break
    assert [a["parameters"] for a in acks] == [{"stop": [stop]}]
    completion = messages[-1]
    assert completion["finish_reason"] == "stop", completion
    streamed = token_ids(messages)
    assert streamed == expected[: len(streamed)]
    assert "".join(m["token"] for m in messages if m["type"] == "token") == full[:cut]
    assert completion["generated_text"] == full[:cut]


async def test_regenerate_restarts_with_a_fresh_init(stack, hf_greedy):
    ids = prompt_ids(stack, prompt=PROMPTS[0])
    expected = hf_greedy(ids, MAX_TOKENS)
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", **greedy_config(prompt=PROMPTS[0], max_tokens=MAX_TOKENS)})
        first = await receive(ws)
        assert (await receive(ws))["type"] == "token"
        await send(ws, {"type": "control", "action": "regenerate"})
        while (message := await receive(ws))["type"] != "init":
            assert message["type"] == "token"  # sent before the regenerate landed; no completion
        messages = [message] + await collect(ws)
        assert messages[0]["request_id"] != first["request_id"]
        check_stream(stack, messages, expected, len(ids))
        # after a completion, regenerate runs the same configuration once more
        await send(ws, {"type": "control", "action": "regenerate"})
        again = await collect(ws)
        check_stream(stack, again, expected, len(ids))
        assert again[0]["request_id"] not in (first["request_id"], messages[0]["request_id"])


async def test_feedback_is_stored_with_the_request(stack):
    async with websockets.connect(stack.ws_url) as ws:
        messages = await generate(ws, {"prompt": PROMPTS[0], "parameters": {"max_tokens": 3, "temperature": 0}})
        rid = messages[0]["request_id"]
        await send(ws, {"type": "feedback", "rating": 0.5, "text": "good", "position": 2})
        ack = await receive(ws)
        assert ack["type"] == "status" and ack["operation"] == "feedback" and ack["request_id"] == rid
        assert isinstance(ack["feedback_id"], int)
        await send(ws, {"type": "feedback", "rating": -1})
        assert (await receive(ws))["feedback_id"] > ack["feedback_id"]
        await send(ws, {"type": "feedback", "rating": 2})
        assert (await receive(ws))["message"].startswith("rating:")
        await send(ws, {"type": "feedback", "rating": 1, "position": 2**64})
        assert (await receive(ws))["message"].startswith("position: Input should be less than or equal to")

    async with httpx.AsyncClient(base_url=stack.http_url) as client:

        async def finished() -> bool:
            record = (await client.get(f"/v1/requests/{rid}")).json()
            return record.get("finish_reason") == "length"

        await wait_for(finished, 10, "the completion record")
        record = (await client.get(f"/v1/requests/{rid}")).json()
    assert record["rid"] == rid and record["surface"] == "websocket" and record["prompt"] == PROMPTS[0]
    assert record["generated_text"] == messages[-1]["generated_text"] and record["completion_tokens"] == 3
    assert [(f["rating"], f["text"], f["position"]) for f in record["feedback"]] == [(0.5, "good", 2), (-1.0, "", None)]


# -- bad input --------------------------------------------------------------------------------------

BAD_FIRST_MESSAGES = [
    ("not json", "message is not valid JSON"),
    ("[1, 2]", "message must be a JSON object, not list"),
    ('"config"', "message must be a JSON object, not str"),
    ({"prompt": "x"}, "message has no 'type' field"),
    ({"type": "generate"}, "type: unknown message type 'generate'"),
    ({"type": "control", "action": "stop"}, "the first message must be a config message, not 'control'"),
    ({"type": "feedback", "rating": 1}, "the first message must be a config message, not 'feedback'"),
]

BAD_CONFIGS = [
    ({"prompt": 42}, "prompt: Input should be a valid string"),
    ({"prompt": ""}, "prompt: String should have at least 1 character"),
    ({}, "give exactly one of 'prompt' (text) or 'messages' (chat)"),
    ({"prompt": "x", "model": "llama-7b"}, "model: model 'llama-7b' is not served here"),
    (
        {"prompt": "x", "parameters": {"temperature": -0.5}},
        "parameters.temperature: Input should be greater than or equal to 0",
    ),
    ({"prompt": "x", "parameters": {"top_p": 0}}, "parameters.top_p: Input should be greater than 0"),
    ({"prompt": "x", "parameters": {"top_p": 1.1}}, "parameters.top_p: Input should be less than or equal to 1"),
    ({"prompt": "x", "parameters": {"top_k": -1}}, "parameters.top_k: Input should be greater than or equal to 0"),
    (
        {"prompt": "x", "parameters": {"max_tokens": 0}},
        "parameters.max_tokens: Input should be greater than or equal to 1",
    ),
    ({"prompt": "x", "parameters": {"max_tokens": 10**6}}, "parameters.max_tokens: must be at most"),
    ({"prompt": "x", "parameters": {"max_tokens": "ten"}}, "parameters.max_tokens: Input should be a valid integer"),
    (
        {"prompt": "x", "parameters": {"repetition_penalty": 0}},
        "parameters.repetition_penalty: Input should be greater than 0",
    ),
    ({"prompt": "x", "parameters": {"stop": ["s"] * 100}}, "parameters.stop: at most"),
    ({"prompt": "x", "options": {"echo_prompt": "yes"}}, "options.echo_prompt: Input should be a valid boolean"),
    # beyond int64 (msgpack, torch seeds): refused up front, not an internal_error after init
    ({"prompt": "x", "parameters": {"seed": 2**64}}, "parameters.seed: Input should be less than or equal to"),
    (
        '{"type": "config", "prompt": "x", "parameters": {"temperature": Infinity}}',
        "parameters.temperature: Input should be a finite number",
    ),
]


async def expect_error(ws, message, fragment: str, code: str = "invalid_request") -> dict:
    await send(ws, message)
    reply = await receive(ws)
    assert reply["type"] == "error" and reply["error"] == code, reply
    assert fragment in reply["message"], reply
    assert reply["request_id"] is None and reply["recoverable"] is True
    return reply


async def test_bad_input_keeps_the_connection_usable(stack):
    async with websockets.connect(stack.ws_url) as ws, websockets.connect(stack.ws_url) as other:
        for message, fragment in BAD_FIRST_MESSAGES:
            await expect_error(ws, message, fragment)
        for config, fragment in BAD_CONFIGS:
            await expect_error(ws, config if isinstance(config, str) else {"type": "config", **config}, fragment)
        await expect_error(ws, {"type": "control", "action": "stop"}, "cannot stop: no generation is running")
        await expect_error(ws, {"type": "control", "action": "pause"}, "cannot pause: no generation is running")
        await expect_error(
            ws, {"type": "control", "action": "regenerate"}, "cannot regenerate: no generation has been configured"
        )
        await expect_error(ws, {"type": "feedback", "rating": 1}, "no generation on this connection")

        await send(ws, {"type": "config", "prompt": PROMPTS[0], "parameters": {"max_tokens": 200, "ignore_eos": True}})
        assert (await receive(ws))["type"] == "init"
        running = [
            ({"type": "config", "prompt": "again"}, "a generation is already running"),
            (
                {"type": "control", "action": "rewind"},
                "action: Input should be 'stop', 'pause', 'resume', 'regenerate' or 'modify'",
            ),
            ({"type": "control", "action": "modify"}, "'modify' needs a 'parameters' object"),
            ({"type": "control", "action": "modify", "parameters": {"top_p": 2}}, "parameters.top_p:"),
            ({"type": "control", "action": "modify", "parameters": {"speed": 2}}, "parameters.speed: unknown field"),
            ({"type": "feedback", "rating": "good"}, "rating: Input should be a valid number"),
            ("{{", "message is not valid JSON"),
        ]
        for message, fragment in running:
            await send(ws, message)
            while (reply := await receive(ws))["type"] == "token":
                pass
            assert reply["type"] == "error" and fragment in reply["message"] and reply["request_id"] is None, reply
        await send(ws, {"type": "control", "action": "stop"})
        assert (await collect(ws))[-1]["finish_reason"] == "cancelled"

        for ws_ in (ws, other):
            messages = await generate(ws_, {"prompt": PROMPTS[0], "parameters": {"max_tokens": 2}})
            assert kinds(messages) == ["init", "token", "token", "completion"]


async def test_context_length_exceeded(stack):
    limit = stack.settings.limits.max_model_len
    async with websockets.connect(stack.ws_url) as ws:
        reply = await expect_error(
            ws, {"type": "config", "prompt": " hello" * (limit + 10)}, "leaves no room", "context_length_exceeded"
        )
        assert reply["recovery_action"] == "reduce_prompt"
        reply = await expect_error(
            ws,
            {"type": "config", "prompt": "Hello", "parameters": {"max_tokens": limit}},
            "ask for at most",
            "context_length_exceeded",
        )
        assert reply["param"] == "max_tokens" and reply["recovery_action"] == "reduce_max_tokens"
        assert kinds(await generate(ws, {"prompt": "Hello", "parameters": {"max_tokens": 1}}))[-1] == "completion"


async def test_oversize_frame_closes_with_1009(stack):
    async with websockets.connect(stack.ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "config", "prompt": "x" * (stack.settings.limits.max_ws_message_bytes + 1)}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await receive(ws)
        assert closed.value.rcvd.code == 1009
    assert kinds(await ws_generate(stack.ws_url, {"prompt": "Hi", "parameters": {"max_tokens": 1}}))[-1] == "completion"


async def test_killed_client_frees_its_sequence(stack):
    ws = await websockets.connect(stack.ws_url)
    await send(ws, {"type": "config", "prompt": PROMPTS[0], "parameters": {"max_tokens": 1000, "ignore_eos": True}})
    assert (await receive(ws))["type"] == "init"
    assert (await receive(ws))["type"] == "token"
    assert (await asyncio.to_thread(stack.scheduler_health))["running"] >= 1
    ws.transport.abort()  # no close handshake: the client process died
    await wait_for(lambda: scheduler_idle(stack), 10, "the scheduler to free the killed client's sequence")
    async with httpx.AsyncClient(base_url=stack.http_url) as client:
        metrics = (await client.get("/metrics")).text
    assert 'tiller:requests_total{outcome="cancelled",surface="websocket"}' in metrics
