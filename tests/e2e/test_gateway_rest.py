"""``POST /v1/generate`` (JSON and SSE), health, metrics and request records, on the real stack."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.gateway.support import kinds, parse_sse, scheduler_idle, token_ids, wait_for

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture
async def client(stack):
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def expected(stack, hf_greedy) -> list[int]:
    return hf_greedy(stack.tokenizer(PROMPT).input_ids, MAX_TOKENS)


async def test_json_flat_body(stack, client, expected):
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": False,
        "include_token_ids": True,
        "include_timing": True,
    }
    reply = await client.post("/v1/generate", json=body)
    assert reply.status_code == 200
    result = reply.json()
    assert result["id"].startswith("gen_") and result["model"] == stack.settings.served_model_name
    assert result["token_ids"] == expected
    assert result["generated_text"] == stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert result["finish_reason"] == "length"
    n_prompt = len(stack.tokenizer(PROMPT).input_ids)
    assert result["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": MAX_TOKENS,
        "total_tokens": n_prompt + MAX_TOKENS,
    }
    assert result["timing"]["first_token_ms"] <= result["timing"]["total_ms"]


@pytest.mark.parametrize("options", [None, {"include_token_ids": True}])
async def test_without_stream_the_answer_is_json(stack, client, expected, options):
    """REST's default is one JSON answer (the WebSocket's is to stream), flat or with nested options."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **({"options": options} if options else {})}
    reply = await client.post("/v1/generate", json=body)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json", reply.text
    result = reply.json()
    assert result["generated_text"] == stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert result.get("token_ids") == (expected if options else None)


async def test_json_nested_body_with_chat_and_echo(stack, client, hf_greedy):
    messages = [{"role": "user", "content": "Name a fruit."}]
    text = stack.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf_greedy(stack.tokenizer(text, add_special_tokens=False).input_ids, 4)
    body = {
        "messages": messages,
        "parameters": {"max_tokens": 4, "temperature": 0},
        "options": {"stream": False, "echo_prompt": True},
    }
    result = (await client.post("/v1/generate", json=body)).json()
    assert result["generated_text"] == text + stack.tokenizer.decode(ids, skip_special_tokens=True)


async def test_sse_stream(stack, client, expected):
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "include_token_ids": True,
        "include_logprobs": 1,
    }
    reply = await client.post("/v1/generate", json=body)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(reply.text)
    assert kinds(events) == ["init"] + ["token"] * MAX_TOKENS + ["completion"]
    assert token_ids(events) == expected
    assert all(len(e["logprobs"]) == 2 for e in events if e["type"] == "token")
    assert events[-1]["generated_text"] == events[-2]["generated_text"]
    assert events[-1]["request_id"] == events[0]["request_id"]


@pytest.mark.parametrize(
    ("body", "status", "kind", "fragment"),
    [
        ("{oops", 400, "invalid_request", "not valid JSON"),
        ("[]", 400, "invalid_request", "must be a JSON object"),
        ({"prompt": "x", "temperature": -1}, 400, "invalid_request", "parameters.temperature:"),
        ({"prompt": "x", "top_p": 0}, 400, "invalid_request", "parameters.top_p:"),
        ({"prompt": "x", "max_tokens": 0}, 400, "invalid_request", "parameters.max_tokens:"),
        ({"prompt": "x", "max_tokens": 3, "parameters": {"max_tokens": 4}}, 400, "invalid_request", "given both"),
        ({"prompt": ["x"]}, 400, "invalid_request", "prompt:"),
        ({"prompt": "x", "model": "gpt-4"}, 400, "invalid_request", "not served here"),
        ({"prompt": " hi" * 3000}, 400, "context_length_exceeded", "leaves no room"),
    ],
)
async def test_errors(client, body, status, kind, fragment):
    if isinstance(body, str):
        reply = await client.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    else:
        reply = await client.post("/v1/generate", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["type"] == kind and fragment in error["message"]
    assert error["recoverable"] is True and error["recovery_action"] in ("fix_request", "reduce_prompt")


async def test_body_size_limit(stack, client):
    reply = await client.post("/v1/generate", json={"prompt": "x" * stack.settings.limits.max_http_body_bytes})
    assert reply.status_code == 400 and "exceeds" in reply.json()["error"]["message"]


async def test_sse_disconnect_frees_the_sequence(stack, client):
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/generate", json=body) as reply:
        async for line in reply.aiter_lines():  # leave once a token came (the request is generating)
            if line.startswith("data: {") and parse_sse(line)[0]["type"] == "token":
                break
    await wait_for(lambda: scheduler_idle(stack), 10, "the scheduler to free the abandoned SSE stream")


async def test_non_streaming_disconnect_frees_the_sequence(stack, client):
    request = asyncio.create_task(
        client.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": False})
    )

    async def running() -> bool:
        return (await asyncio.to_thread(stack.scheduler_health))["running"] >= 1

    await wait_for(running, 30, "the request to run")
    request.cancel()
    await wait_for(lambda: scheduler_idle(stack), 30, "the scheduler to free the abandoned request")


async def test_health(stack, client):
    reply = await client.get("/health")
    assert reply.status_code == 200
    health = reply.json()
    assert health["status"] == "ready" and health["scheduler"]["worker"]["stage"] == "ready"
    assert health["scheduler"]["max_model_len"] == stack.settings.limits.max_model_len
    [worker] = health["scheduler"]["workers"]
    assert worker["forward"] == "paged" and worker["fallback_reason"] == ""  # the default model runs natively


async def test_metrics(client):
    await client.post("/v1/generate", json={"prompt": "Hi", "max_tokens": 2, "stream": False})
    await client.post("/v1/generate", json={"prompt": "Hi", "temperature": -1})
    text = (await client.get("/metrics")).text
    assert 'tiller:requests_total{outcome="length",surface="rest"}' in text
    assert 'tiller:generation_tokens_total{surface="rest"}' in text
    assert 'tiller:time_to_first_token_seconds_bucket{le="0.25",surface="rest"}' in text
    assert 'tiller:active_streams{surface="rest"} 0.0' in text


async def test_metrics_report_the_kv_pool(client):
    capacity = (await client.get("/health")).json()["scheduler"]["kv_capacity_tokens"]
    text = (await client.get("/metrics")).text
    gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith(("tiller:kv_", "tiller:queued", "tiller:running", "tiller:scheduler_up"))}
    assert gauges["tiller:scheduler_up"] == 1
    assert gauges["tiller:kv_capacity_tokens"] == capacity > 0
    assert 0 <= gauges["tiller:kv_free_tokens"] <= capacity
    parts = ("tiller:kv_free_tokens", "tiller:kv_cached_tokens", "tiller:kv_used_tokens")
    assert sum(gauges[name] for name in parts) == capacity, gauges
    assert gauges["tiller:queued"] >= 0 and gauges["tiller:running"] >= 0


async def test_request_record(client):
    result = (
        await client.post("/v1/generate", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0.5, "stream": False})
    ).json()

    async def recorded() -> bool:
        reply = await client.get(f"/v1/requests/{result['id']}")
        return reply.status_code == 200 and reply.json()["finish_reason"] is not None

    await wait_for(recorded, 10, "the request record")
    record = (await client.get(f"/v1/requests/{result['id']}")).json()
    assert record["surface"] == "rest" and record["generated_text"] == result["generated_text"]
    assert record["params"]["temperature"] == 0.5 and record["params"]["max_tokens"] == 2 and record["feedback"] == []
    missing = await client.get("/v1/requests/gen_missing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
