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
