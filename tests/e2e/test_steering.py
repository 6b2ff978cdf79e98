"""Activation steering end to end on the real stack and the default model (docs/steering.md).

The oracle is transformers on the same weights with forward hooks on ``model.model.layers[i]`` adding the same
directions at the same positions (recomputing the whole sequence each token): every surface's greedy text under
steering equals it (OpenAI completions and chat, ``/v1/generate``, the WebSocket protocol with a ``modify`` that
changes the steering mid-stream, AICI ``/v1/run``, Salience through its ``tiller-steering`` metadata, an Evergreen
action config), in each position mode, two vectors together; steered KV is never reused by an unsteered request nor
the reverse; ``vectors:build`` makes a vector from pairs of texts (with its progress); bad steering gets a specific
error on each surface."""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc
import httpx
import numpy as np
import pytest
import torch
import websockets

from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from services.gateway.salience.service import CACHED_TOKENS_TRAILER
from tests.e2e.test_evergreen import config, eot, generate as eg_generate, msg, parent, run_session, text
from tests.gateway.support import collect, greedy_config, parse_sse, send, token_ids

TOKENS = 8
PROMPT = "The weather today is"
QUESTION = "Name a colour."
LAYERS = (6, 14)
RPC_TIMEOUT_S = 120.0

# (directions by layer, scale, positions[, the position it stops at]) as the oracle adds them
Added = list[tuple]


@pytest.fixture(scope="module")
def http(stack) -> httpx.Client:
    with httpx.Client(base_url=stack.http_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def directions(stack, hf_model) -> dict[int, np.ndarray]:
    """Random directions at LAYERS, each half as long as the residual stream there on PROMPT: enough to move the
    greedy tokens."""
    ids = stack.tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        states = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    rng = np.random.default_rng(7)
    out = {}
    for layer in LAYERS:
        d = rng.standard_normal(states[layer + 1].shape[-1])
        out[layer] = (d / np.linalg.norm(d) * 0.5 * float(states[layer + 1][0, -1].norm())).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def vector(http, directions) -> str:
    reply = http.post("/v1/steering/vectors", json={"directions": {str(k): v.tolist() for k, v in directions.items()}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["layers"] == list(LAYERS)
    return reply.json()["id"]


@pytest.fixture(scope="module")
def oracle(hf_model) -> Callable[[list[int], Added, int], list[int]]:
    def greedy(prompt_ids: list[int], added: Added, n: int = TOKENS) -> list[int]:
        start = len(prompt_ids)

        def hook(index: int):
            def add(module, args, output):
                hidden = output[0] if isinstance(output, tuple) else output
                positions = torch.arange(hidden.shape[1])
                for found, scale, mode, *until in added:
                    if index in found:
                        covered = {"all": positions >= 0, "prompt": positions < start,
                                   "generated": positions >= start}[mode]
                        covered = covered & (positions < until[0]) if until else covered
                        hidden = hidden + covered[None, :, None] * (scale * torch.from_numpy(found[index]))
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
            return add

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(hf_model.model.layers)]
        ids = list(prompt_ids)
        try:
            with torch.inference_mode():
                for _ in range(n):
                    ids.append(int(hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        finally:
            for handle in handles:
                handle.remove()
        return ids[start:]

    return greedy


def _chat_ids(stack, content: str) -> list[int]:
    rendered = stack.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                   tokenize=False)
    return stack.tokenizer(rendered, add_special_tokens=False).input_ids


def _decoded(stack, ids: list[int]) -> str:
    return stack.tokenizer.decode(ids, skip_special_tokens=True)


def test_openai_completions_in_each_position_mode_and_two_vectors_together(stack, http, vector, directions, oracle):
    ids = stack.tokenizer(PROMPT).input_ids
    unsteered = oracle(ids, [])
    for mode, scale in (("all", 1.0), ("prompt", 1.5), ("generated", 1.0)):
        steering = [{"vector": vector, "scale": scale, "positions": mode}]
        reply = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                                  "steering": steering})
        assert reply.status_code == 200, reply.text
        expected = oracle(ids, [(directions, scale, mode)])
        assert reply.json()["choices"][0]["text"] == _decoded(stack, expected), mode
        if mode == "all":
            assert expected != unsteered  # the steering moves the tokens: the comparison means something
    # a vector named twice with layers of its own choosing, and a concept, add up
    steering = [{"vector": vector, "scale": 1.0, "layers": [LAYERS[0]]},
                {"vector": vector, "scale": -0.5, "layers": [LAYERS[1]], "positions": "generated"}]
    reply = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                              "steering": steering})
    first, second = {LAYERS[0]: directions[LAYERS[0]]}, {LAYERS[1]: directions[LAYERS[1]]}
    expected = oracle(ids, [(first, 1.0, "all"), (second, -0.5, "generated")])
    assert reply.json()["choices"][0]["text"] == _decoded(stack, expected)


async def test_chat_rest_run_salience_and_evergreen_take_the_same_steering(stack, http, vector, directions, oracle):
    steering = [{"vector": vector, "scale": 1.0}]
    chat_ids = _chat_ids(stack, QUESTION)
    chat_expected = _decoded(stack, oracle(chat_ids, [(directions, 1.0, "all")]))
    plain_expected = oracle(stack.tokenizer(PROMPT).input_ids, [(directions, 1.0, "all")])

    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                   "max_tokens": TOKENS, "temperature": 0, "steering": steering})
    assert chat.json()["choices"][0]["message"]["content"] == chat_expected, chat.text
    rest = http.post("/v1/generate", json={"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                                           "steering": steering})
    assert rest.json()["generated_text"] == _decoded(stack, plain_expected), rest.text
    run = http.post("/v1/run", json={"controller": "none", "controller_arg": PROMPT, "max_tokens": TOKENS,
                                     "steering": steering})
    texts = [fork["text"] for event in parse_sse(run.text)[1:-1] for fork in event["forks"]]
    assert "".join(texts) == _decoded(stack, plain_expected), run.text
    assert await _salience(stack, stack.tokenizer(PROMPT).input_ids, json.dumps(steering)) == plain_expected
    assert await _evergreen(stack, steering) == chat_expected


async def _salience(stack, ids: list[int], steering: str) -> list[int]:
    """Greedy tokens of a Salience session's first turn, steered through the call's metadata."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
        stub = pb_grpc.SalienceStub(channel)
        session = (await stub.OpenSession(pb.OpenSessionRequest(model=stack.settings.served_model_name))).session_id
        events = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=ids, max_tokens=TOKENS, top_k=1),
                               metadata=(("tiller-steering", steering),), timeout=RPC_TIMEOUT_S)
        return [e.token.id async for e in events if e.HasField("token") and not e.token.is_prefill]


async def _evergreen(stack, steering: list[dict]) -> str:
    """The text of an Evergreen GENERATE whose action config carries the steering, on QUESTION as a user turn."""
    action = eg_generate("q", "a", names=("text", "text"),
                         configs=(config(max_tokens=TOKENS, temperature=0, steering=steering),))
    result = await run_session(stack, msg(action, parent("q", "q_text", "q_eot"), text("q_text", QUESTION),
                                          eot("q_eot")))
    assert result.code == grpc.StatusCode.OK, result.details
    return result.text("a")


async def test_a_websocket_modify_changes_the_steering_from_the_next_token(stack, vector, directions, oracle):
    """Paused after its first token, the generation takes a modify that ends the steering: its tokens are those
    of a sequence steered at every position before some position q (where the pause caught it) and at none after."""
    ids = stack.tokenizer(PROMPT).input_ids
    n = 24
    config_msg = greedy_config(prompt=PROMPT, max_tokens=n)
    config_msg["parameters"]["steering"] = [{"vector": vector, "scale": 1.0}]
    async with websockets.connect(stack.ws_url) as ws:
        await send(ws, {"type": "config", **config_msg})
        seen = []
        while not any(m["type"] == "token" for m in seen):
            seen.append(json.loads(await ws.recv()))
        await send(ws, {"type": "control", "action": "pause"})
        await send(ws, {"type": "control", "action": "modify", "parameters": {"steering": []}})
        await send(ws, {"type": "control", "action": "resume"})
        messages = seen + await collect(ws)
    assert any(m["type"] == "status" and m["operation"] == "modify" for m in messages), messages
    got = token_ids(messages)
    steered = oracle(ids, [(directions, 1.0, "all")], n)
    assert len(got) == n and got != steered  # the modify changed something
    first_change = next(i for i, (a, b) in enumerate(zip(got, steered)) if a != b)
    # token i is sampled after position len(ids) + i - 1: the change took effect at or before that position
    for q in range(len(ids) + first_change - 1, len(ids), -1):
        if oracle(ids, [(directions, 1.0, "all", q)], n) == got:
            return
    pytest.fail(f"no change position explains {got}")


def test_steered_kv_is_never_reused_unsteered_nor_the_reverse(stack, http, vector):
    prompt = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen " * 3

    def cached(steering: list[dict] | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if steering is not None:
            body["steering"] = steering
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(None)
    assert cached(None) > 0  # the plain prompt is cached
    steering = [{"vector": vector, "scale": 1.0, "positions": "generated"}]
    assert cached(steering) == 0  # steered: the plain KV is not taken
    assert cached(steering) > 0  # the same steering again: its own KV is
    assert cached([{"vector": vector, "scale": 2.0, "positions": "generated"}]) == 0  # another scale: not
    cached(None)


JOYFUL = ["wonderful", "great", "lovely", "delightful", "happy", "cheerful", "bright", "joyful"]
GLOOMY = ["awful", "terrible", "dreadful", "miserable", "sad", "gloomy", "dark", "grim"]


def test_a_vector_built_from_sixteen_pairs_is_their_mean_difference(stack, http, hf_model):
    pairs = [(f"{who} day was {good}", f"{who} day was {bad}") for who in ("My", "Her")
             for good, bad in zip(JOYFUL, GLOOMY)]
    layer = 10
    body = {"pairs": [{"positive": p, "negative": n} for p, n in pairs], "layers": [layer], "stream": True,
            "tags": []}
    reply = http.post("/v1/steering/vectors:build", json=body)
    assert reply.status_code == 200, reply.text
    events = parse_sse(reply.text)
    progress = [e for e in events if e.get("object") == "steering.build.progress"]
    assert [e["done"] for e in progress] == list(range(1, 2 * len(pairs) + 1))
    built = events[-1]
    assert built["layers"] == [layer] and len(built["id"]) == 64

    def last_state(text: str) -> np.ndarray:
        with torch.inference_mode():
            states = hf_model(torch.tensor([stack.tokenizer(text).input_ids]), output_hidden_states=True).hidden_states
        return states[layer + 1][0, -1].double().numpy()

    expected = np.mean([last_state(p) - last_state(n) for p, n in pairs], axis=0)
    assert built["norms"][0] == pytest.approx(float(np.linalg.norm(expected)), rel=0.05)
    listed = http.get(f"/v1/steering/vectors/{built['id']}")
    assert listed.status_code == 200 and listed.json()["id"] == built["id"]
    # the same pairs again: the same content, the same id; pca: a unit direction
    again = http.post("/v1/steering/vectors:build", json={**body, "stream": False})
    assert again.json()["id"] == built["id"], again.text
    pca = http.post("/v1/steering/vectors:build", json={**body, "stream": False, "method": "pca"})
    assert pca.json()["norms"][0] == pytest.approx(1.0, rel=1e-5), pca.text


@pytest.mark.parametrize("steering,message", [
    ([{"vector": "0" * 64, "scale": 1.0}], "steering"),
    ([{"vector": "concept:nonsense-word", "scale": 1.0}], "not a readout concept"),
    ("not a list", "steering"),
])
def test_bad_steering_is_refused_on_each_http_surface(stack, http, steering, message):
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/generate", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/run", {"controller": "none", "controller_arg": PROMPT, "max_tokens": 2})):
        reply = http.post(path, json={**body, "steering": steering})
        assert reply.status_code == 400, (path, reply.text)
        assert message in reply.text, (path, reply.text)
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


async def test_a_session_turn_reuses_the_kv_its_steered_turn_before_left(stack, vector, directions, oracle):
    """Two Salience turns under the same steering: the second reuses the first's parked KV (the cached-tokens
    trailer) and both decode as the oracle steered at every position of the whole session."""
    steering = (("tiller-steering", json.dumps([{"vector": vector, "scale": 1.0}])),)
    first_ids, more = stack.tokenizer(PROMPT).input_ids, stack.tokenizer(" And tomorrow").input_ids
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
        stub = pb_grpc.SalienceStub(channel)
        session = (await stub.OpenSession(pb.OpenSessionRequest(model=stack.settings.served_model_name))).session_id

        async def turn(append: list[int], offset: int) -> tuple[list[int], int]:
            call = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=append, offset=offset,
                                                    max_tokens=TOKENS, top_k=1), metadata=steering,
                                 timeout=RPC_TIMEOUT_S)
            ids = [e.token.id async for e in call if e.HasField("token") and not e.token.is_prefill]
            trailers = dict(await call.trailing_metadata() or ())
            return ids, int(trailers[CACHED_TOKENS_TRAILER])

        first, _ = await turn(first_ids, 0)
        second, cached = await turn(more, len(first_ids) + len(first))
    assert first == oracle(first_ids, [(directions, 1.0, "all")])
    history = first_ids + first + more
    assert second == oracle(history, [(directions, 1.0, "all")])
    assert cached == len(first_ids) + len(first) - 1  # all the first turn fed (its last token never was)


async def test_bad_steering_on_grpc_is_invalid_argument(stack, vector):
    async def call(steering: str) -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
            stub = pb_grpc.SalienceStub(channel)
            session = (await stub.OpenSession(pb.OpenSessionRequest(model=stack.settings.served_model_name))).session_id
            events = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=[1, 2, 3], max_tokens=2,
                                                      top_k=1), metadata=(("tiller-steering", steering),),
                                   timeout=RPC_TIMEOUT_S)
            try:
                async for _ in events:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return grpc.StatusCode.OK, ""

    code, details = await call("{not json")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tiller-steering" in details
    code, details = await call(json.dumps([{"vector": vector, "scale": 1e9}]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "steering.max_scale" in details
