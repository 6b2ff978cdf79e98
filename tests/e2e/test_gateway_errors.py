"""The protocol's error types that need other limits or a degraded backend, each produced for real:
extra gateway processes beside the shared stack (content filter, timeout, rate limit), a stack whose
scheduler queue is full, and a gateway whose scheduler is missing, then has no worker, then a worker
that fails to load."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import websockets

from common.config import Limits
from tests.gateway.support import (
    base_env,
    collect,
    gateway,
    gateway_process,
    generate,
    kinds,
    receive,
    scheduler_idle,
    send,
    service,
    wait_for,
    ws_generate,
)
from tests.stack import start_stack

REQUEST_TIMEOUT_S = 5
CODE_PROMPT = "def parse_config(path):\n    \"\"\"Read a TOML file into a dict.\"\"\"\n"


@pytest.fixture(scope="module")
def strict_gateway(stack, tmp_path_factory: pytest.TempPathFactory):
    """A second gateway on the shared stack with a content filter and a short request timeout."""
    env = dict(
        stack.env,
        TILLER_LIMITS__CONTENT_FILTER_PATTERNS=json.dumps(["(?i)forbidden", "Paris"]),
        TILLER_LIMITS__REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S),
    )
    with gateway(env, tmp_path_factory.mktemp("strict")) as address:
        yield address


@pytest.fixture(scope="module")
def limited_gateway(stack, tmp_path_factory: pytest.TempPathFactory):
    """A second gateway on the shared stack allowing two requests per minute per client."""
    with gateway(
        dict(stack.env, TILLER_LIMITS__RATE_LIMIT_PER_MINUTE="2"), tmp_path_factory.mktemp("limited")
    ) as address:
        yield address


async def test_content_filter_refuses_a_prompt(strict_gateway):
    async with websockets.connect(f"ws://{strict_gateway}/generate") as ws:
        messages = await generate(ws, {"prompt": "Tell me something Forbidden"})
        assert kinds(messages) == ["error"]
        error = messages[0]
        assert error["error"] == "content_filter" and error["recoverable"] is False and error["request_id"] is None
        assert kinds(await generate(ws, {"prompt": "Hello", "parameters": {"max_tokens": 1}}))[-1] == "completion"
    async with httpx.AsyncClient(base_url=f"http://{strict_gateway}") as client:
        reply = await client.post("/v1/generate", json={"prompt": "forbidden fruit"})
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "content_filter"
        reply = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "forbidden"}]})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "content_filter"


async def test_content_filter_cancels_a_generation(strict_gateway):
    config = {"prompt": "The capital of France is", "parameters": {"max_tokens": 20, "temperature": 0}}
    messages = await ws_generate(f"ws://{strict_gateway}/generate", config)
    completion = messages[-1]
    assert completion["type"] == "completion" and completion["finish_reason"] == "content_filter"
    assert "Paris" not in json.dumps(messages)  # the filtered text is never sent
    assert completion["usage"]["completion_tokens"] < 20


async def test_timeout_reports_the_partial_text(strict_gateway):
    async with websockets.connect(f"ws://{strict_gateway}/generate") as ws:
        # ignore_eos: a sampled EOS must not end it before the timeout does; code, not a story, so that the
        # text never trips this gateway's content filter ("Paris") and ends it first
        long_run = {"max_tokens": 1500, "ignore_eos": True}
        messages = await generate(ws, {"prompt": CODE_PROMPT, "parameters": long_run})
        error = messages[-1]
        assert kinds(messages)[0] == "init" and error["type"] == "error" and error["error"] == "timeout"
        assert error["request_id"] == messages[0]["request_id"] and error["recovery_action"] == "retry"
        tokens = [m for m in messages if m["type"] == "token"]
        assert tokens and error["generated_text"].startswith(tokens[-1]["generated_text"])
        assert f"{REQUEST_TIMEOUT_S} s" in error["message"]
        assert kinds(await generate(ws, {"prompt": "Hello", "parameters": {"max_tokens": 1}}))[-1] == "completion"
    async with httpx.AsyncClient(base_url=f"http://{strict_gateway}", timeout=REQUEST_TIMEOUT_S * 6) as client:
        reply = await client.post(
            "/v1/generate", json={"prompt": CODE_PROMPT, **long_run, "stream": False}
        )
    assert reply.status_code == 504
    body = reply.json()["error"]
    assert body["type"] == "timeout" and body["generated_text"] and body["request_id"].startswith("gen_")


async def test_requests_of_a_dead_gateway_are_cancelled(stack, tmp_path):
    """A gateway killed mid-stream cannot cancel its requests; the scheduler does, once its heartbeats stop."""
    silence = Limits().gateway_silence_s
    with gateway_process(dict(stack.env), tmp_path) as (address, proc):
        async with websockets.connect(f"ws://{address}/generate", close_timeout=0.1) as ws:
            long_run = {"max_tokens": 1500, "ignore_eos": True}  # about a minute of tokens on CI's CPU
            await send(ws, {"type": "config", "prompt": "Once upon a time", "parameters": long_run})
            while (await receive(ws))["type"] != "token":
                pass
            await asyncio.sleep(2 * Limits().gateway_heartbeat_s)  # heartbeats went out
            proc.kill()
            proc.wait()
            health = await asyncio.to_thread(stack.scheduler_health)
            assert health["running"] == 1, health  # nobody is left to cancel it
            await wait_for(lambda: scheduler_idle(stack), silence + 10,
                           "the scheduler to cancel the dead gateway's request")


async def test_rate_limit_per_client(limited_gateway):
    url = f"ws://{limited_gateway}/generate"
    async with websockets.connect(url) as ws:
        for _ in range(2):
            assert kinds(await generate(ws, {"prompt": "Hi", "parameters": {"max_tokens": 1}}))[-1] == "completion"
        messages = await generate(ws, {"prompt": "Hi", "parameters": {"max_tokens": 1}})
        error = messages[0]
        assert kinds(messages) == ["error"] and error["error"] == "rate_limited" and error["recovery_action"] == "wait"
        assert 0 < error["retry_after"] <= 60
    async with httpx.AsyncClient(base_url=f"http://{limited_gateway}") as client:
        reply = await client.post("/v1/generate", json={"prompt": "Hi", "max_tokens": 1})
        assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limited"
        assert 0 < int(reply.headers["retry-after"]) <= 60
        reply = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"


async def test_memory_pressure_when_the_queue_is_full(tmp_path: Path):
    full = await asyncio.to_thread(start_stack, tmp_path / "full", TILLER_LIMITS__MAX_QUEUED="0")
    try:
        async with websockets.connect(full.ws_url) as ws:
            messages = await generate(ws, {"prompt": "Hi", "parameters": {"max_tokens": 1}})
            assert kinds(messages) == ["init", "error"]
            error = messages[1]
            assert error["error"] == "memory_pressure" and error["recoverable"] and error["recovery_action"] == "retry"
            assert error["request_id"] == messages[0]["request_id"]
        async with httpx.AsyncClient(base_url=full.http_url) as client:
            reply = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "memory_pressure"
    finally:
        await asyncio.to_thread(full.down)


async def test_missing_scheduler_then_loading_then_failed_model(tmp_path: Path):
    env = base_env(tmp_path, TILLER_LIMITS__REQUEST_TIMEOUT_S=str(REQUEST_TIMEOUT_S))
    with gateway(env, tmp_path) as address:
        url, http = f"ws://{address}/generate", f"http://{address}"
        async with httpx.AsyncClient(base_url=http) as client:
            # no scheduler at all
            messages = await ws_generate(url, {"prompt": "Hi"})
            assert kinds(messages) == ["error"] and messages[0]["error"] == "internal_error"
            assert "scheduler did not answer" in messages[0]["message"]
            reply = await client.get("/health")
            assert reply.status_code == 503 and reply.json()["status"] == "unavailable"
            assert "tiller:scheduler_up 0.0" in (await client.get("/metrics")).text

            with service("services.scheduler", env, tmp_path / "scheduler.log"):
                # a scheduler without a worker: the model is "loading" until the request times out
                async with websockets.connect(url) as ws:
                    await wait_for(lambda: _answers(client), 60, "the scheduler")
                    await send(ws, {"type": "config", "prompt": "Hi"})
                    messages = await collect(ws, timeout=30)
                assert kinds(messages)[0] == "init" and kinds(messages)[-1] == "error"
                statuses = messages[1:-1]
                assert statuses and all(m["type"] == "status" and m["operation"] == "model_loading" for m in statuses)
                assert statuses[0]["progress"] == 0 and statuses[0]["message"]
                assert messages[-1]["error"] == "timeout" and "still loading" in messages[-1]["message"]
                reply = await client.get("/health")
                assert reply.status_code == 503 and reply.json()["scheduler"]["worker"]["stage"] == "absent"

                # a worker that cannot load its model
                with service(
                    "services.worker", dict(env, TILLER_MODEL=str(tmp_path / "no-such-model")), tmp_path / "worker.log"
                ):
                    await wait_for(lambda: _worker_stage(client, "failed"), 90, "the worker to report its failure")
                    async with websockets.connect(url) as ws:
                        messages = await generate(ws, {"prompt": "Hi"})
                        assert kinds(messages) == ["init", "error"]
                        error = messages[1]
                        assert error["error"] == "model_loading_error" and error["recoverable"] is False
                        assert error["recovery_action"] == "contact_operator" and "no-such-model" in error["message"]
                        await send(ws, {"type": "config", "prompt": 5})
                        assert (await receive(ws))["error"] == "invalid_request"


async def _answers(client: httpx.AsyncClient) -> bool:
    return (await client.get("/health")).json()["status"] != "unavailable"


async def _worker_stage(client: httpx.AsyncClient, stage: str) -> bool:
    body = (await client.get("/health")).json()
    return (body.get("scheduler") or {}).get("worker", {}).get("stage") == stage
