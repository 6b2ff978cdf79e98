"""A load-test-like burst of every kind of client at once, many of them leaving early, then checks
that nothing was lost or leaked: the scheduler goes idle, every KV reservation is given back, the
worker's pool is whole again, and greedy output is still token for token what transformers gives.

The abrupt endings are the ones load tools produce: a WebSocket dropped without a close frame, an
SSE stream closed after its first chunk, a stop or pause sent mid-stream, a controlled generation
abandoned, a bad config in the middle of the burst, a Salience turn cancelled and its session closed,
an Evergreen session cancelled as its output begins.
"""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx
import websockets
from google.protobuf import any_pb2, struct_pb2

from common.protos.evergreen.v2 import evergreen_pb2 as eg
from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc
from common.protos.salience.v1 import salience_pb2 as sal
from common.protos.salience.v1 import salience_pb2_grpc as sal_grpc
from services.worker.kv_cache import BLOCK_SIZE
from tests.gateway.support import collect, greedy_config, receive, send, token_ids, wait_for

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colours:",
]
FULL_TOKENS = 12
LONG = {"max_tokens": 400, "ignore_eos": True}


async def full_greedy(stack, prompt: str) -> tuple[str, list[int]]:
    """A whole greedy generation: its prompt and the token ids it streamed."""
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", **greedy_config(prompt=prompt, max_tokens=FULL_TOKENS)})
        messages = await collect(ws)
    assert messages[-1]["type"] == "completion", messages[-1]
    return prompt, token_ids(messages)


async def dropped_socket(stack, prompt: str, after: int) -> None:
    """Reads ``after`` tokens, then drops the TCP connection without a close frame."""
    ws = await websockets.connect(stack.ws_url)
    await send(ws, {"type": "config", "prompt": prompt, "parameters": LONG})
    assert (await receive(ws))["type"] == "init"
    for _ in range(after):
        assert (await receive(ws))["type"] == "token"
    ws.transport.abort()


async def stopped(stack, prompt: str) -> None:
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", "prompt": prompt, "parameters": LONG})
        assert (await receive(ws))["type"] == "init"
        assert (await receive(ws))["type"] == "token"
        await send(ws, {"type": "control", "action": "stop"})
        assert (await collect(ws))[-1]["finish_reason"] == "cancelled"


async def paused_then_gone(stack, prompt: str) -> None:
    """Pauses its generation (the sequence stays held), then leaves while paused."""
    ws = await websockets.connect(stack.ws_url)
    await send(ws, {"type": "config", "prompt": prompt, "parameters": LONG})
    assert (await receive(ws))["type"] == "init"
    await send(ws, {"type": "control", "action": "pause"})
    while (await receive(ws))["type"] != "status":
        pass
    await ws.close()


async def bad_config(stack) -> None:
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", "prompt": "x", "parameters": {"temperature": -1}})
        error = await receive(ws)
    assert error["type"] == "error" and "temperature" in json.dumps(error)


async def sse_closed_early(stack, prompt: str) -> None:
    """An OpenAI streaming completion whose client goes away after the first chunk."""
    async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
        body = {"model": stack.settings.served_model_name, "prompt": prompt, "stream": True, **LONG}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break


async def controlled_abandoned(stack, prompt: str) -> None:
    """A generation steered by a controller (a regex), dropped after its first token."""
    arg = {"regex": "[a-z ]{5,200}", "max_tokens": 200}
    ws = await websockets.connect(stack.ws_url)
    await send(ws, {"type": "config", "prompt": prompt, "controller": "native:constrained",
                    "controller_arg": json.dumps(arg), "parameters": {"max_tokens": 200, "temperature": 0.8}})
    assert (await receive(ws))["type"] == "init"
    assert (await receive(ws))["type"] == "token"
    ws.transport.abort()


async def salience_cancelled(stack, prompt: str) -> None:
    """A Salience turn whose client cancels the call after its first decoded token, then closes
    the session."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
        stub = sal_grpc.SalienceStub(channel)
        opened = await stub.OpenSession(sal.OpenSessionRequest(model=stack.settings.served_model_name))
        ids = stack.tokenizer(prompt).input_ids
        call = stub.Generate(sal.GenerateRequest(session_id=opened.session_id, append_tokens=ids, max_tokens=400,
                                                 top_k=1))
        async for event in call:
            if event.HasField("token") and not event.token.is_prefill:
                break
        else:
            raise AssertionError("the turn ended before its first decoded token")
        call.cancel()
        await stub.CloseSession(sal.CloseSessionRequest(session_id=opened.session_id))


async def evergreen_dropped(stack, prompt: str) -> None:
    """An Evergreen session whose client cancels the stream once the generation's output begins."""
    text = eg.Chunk(data=prompt.encode(), metadata=eg.ChunkMetadata(mimetype="text/plain", role="user"))
    config = any_pb2.Any()
    config.Pack(struct_pb2.Struct(fields={"max_tokens": struct_pb2.Value(number_value=400)}))
    action = eg.Action(name="GENERATE", inputs=[eg.NamedParameter(name="prompt", id="p")],
                       outputs=[eg.NamedParameter(name="response", id="r")], configs=[config])
    first = eg.SessionMessage(node_fragments=[eg.NodeFragment(id="p", chunk_fragment=text)], actions=[action])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
        call = eg_grpc.EvergreenServiceStub(channel).StartSession()
        await call.write(first)
        async for message in call:
            if any(f.id == "r" for f in message.node_fragments):
                break
        else:
            raise AssertionError("the session ended before its output began")
        call.cancel()


async def engine_state(stack) -> dict:
    return await asyncio.to_thread(stack.scheduler_health)


async def test_a_burst_of_clients_leaving_every_way_loses_nothing(stack, hf_greedy):
    rng = random.Random(7)
    before = await engine_state(stack)
    parked = before["parked_tokens"]  # other tests' sessions may hold KV; the burst must not change it
    reserved = before["kv_reserved_tokens"]  # theirs (in whole blocks), as nothing else runs
    clients = []
    for i in range(6):
        prompt = PROMPTS[i % len(PROMPTS)]
        clients += [
            full_greedy(stack, prompt),
            dropped_socket(stack, prompt, after=rng.randint(0, 3)),
            stopped(stack, prompt),
            sse_closed_early(stack, prompt),
        ]
    clients += [paused_then_gone(stack, PROMPTS[0]), paused_then_gone(stack, PROMPTS[1]), bad_config(stack)]
    clients += [controlled_abandoned(stack, PROMPTS[3]) for _ in range(3)]
    clients += [salience_cancelled(stack, p) for p in PROMPTS[:2]] + [evergreen_dropped(stack, p) for p in PROMPTS[2:]]
    rng.shuffle(clients)
    results = await asyncio.wait_for(asyncio.gather(*clients), timeout=300)

    for result in results:
        if result is not None:  # a whole greedy generation, batched with everything else
            prompt, streamed = result
            assert streamed == hf_greedy(stack.tokenizer(prompt).input_ids, FULL_TOKENS), prompt

    async def settled() -> bool:
        state = await engine_state(stack)
        return (state["running"], state["queued"], state["paused"]) == (0, 0, 0) and (
            state["parked_tokens"] == parked and state["kv_reserved_tokens"] == reserved
        )

    await wait_for(settled, 30, "every request to end and its KV reservation to be given back")
    # one more request makes a step, whose result reports the pool after every free has landed
    prompt, streamed = await full_greedy(stack, PROMPTS[2])
    assert streamed == hf_greedy(stack.tokenizer(prompt).input_ids, FULL_TOKENS)
    await wait_for(settled, 30, "the last request to end")
    after = await engine_state(stack)
    # parked sessions (of other tests) hold at most their tokens plus one partial block each
    held_by_sessions = parked + after["parked_sessions"] * BLOCK_SIZE
    assert after["kv_free_tokens"] + after["kv_cached_tokens"] >= after["kv_capacity_tokens"] - held_by_sessions, after
    assert after["kv_used_tokens"] <= held_by_sessions, after
