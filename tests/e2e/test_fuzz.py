"""A fixed-seed fuzz per surface: every HTTP JSON route, the WebSocket, module upload, Salience and Evergreen,
2,000 mutated requests each (see :mod:`tests.fuzzing`). Each answer is a success or a client error in the
surface's shape — never a 5xx, ``internal_error``, INTERNAL or UNKNOWN — no process restarts, and greedy output
is the same afterwards.

The cases run against an extra gateway on the shared stack whose generations are at most two tokens
(``default_max_tokens`` and ``max_tokens_cap`` 2), so a case that generates stays cheap.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc
import httpx
import pytest
import websockets
from google.protobuf.message_factory import GetMessageClass

from common.protos.evergreen.v2 import evergreen_pb2 as eg
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from tests.fuzzing import ProtoFuzzer, json_case, wasm_case
from tests.gateway.support import FINAL, call_status, gateway_process, greedy_config, receive, token_ids, ws_generate
from tests.stack import ROOT, free_port

CASES = 2000
CONCURRENCY = 8
SERVICES = ("gateway", "session_store", "scheduler", "worker", "controller_runtime")
SERVER_FAULTS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
GREEDY_PROMPT = "The quick brown fox"
GREEDY_TOKENS = 8
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "seed", "logit_bias",
          "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "stop_token_ids", "response_format",
          "ignore_eos", "repetition_penalty", "best_of", "suffix", "user", "tools", "tool_choice",
          "add_generation_prompt", "continue_final_message", "add_special_tokens", "tokens", "return_token_strs",
          "parameters", "options", "controller", "controller_arg", "module_id", "tags", "type"]


NUMERIC_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed", "max_tokens", "n", "logprobs", "min_tokens"]
EXTREMES = [2**64, -(2**63) - 1, 1e308, 1e-320, -0.5, 0]


class Fuzzed:
    """The fuzzed gateway: its addresses and process."""

    def __init__(self, http: str, grpc_address: str, proc) -> None:
        self.http, self.grpc, self.proc = http, grpc_address, proc


@pytest.fixture(scope="module")
def fuzzed(stack, tmp_path_factory) -> Iterator[Fuzzed]:
    grpc_port = free_port()
    env = dict(stack.env, TILLER_LIMITS__DEFAULT_MAX_TOKENS="2", TILLER_LIMITS__MAX_TOKENS_CAP="2")
    with gateway_process(env, tmp_path_factory.mktemp("fuzz"), grpc_port=grpc_port) as (address, proc):
        yield Fuzzed(address, f"127.0.0.1:{grpc_port}", proc)


@pytest.fixture(scope="module")
def expected_greedy(stack, hf_greedy) -> list[int]:
    return hf_greedy(stack.tokenizer.encode(GREEDY_PROMPT), GREEDY_TOKENS)


@pytest.fixture
async def intact(stack, fuzzed, expected_greedy) -> AsyncIterator[None]:
    """Around a fuzz test: no process restarted, the fuzzed gateway still up, greedy output unchanged."""
    pids = {service: stack.pid(service) for service in SERVICES}
    yield
    assert fuzzed.proc.poll() is None, "the fuzzed gateway exited"
    assert {service: stack.pid(service) for service in SERVICES} == pids
    messages = await ws_generate(stack.ws_url, greedy_config(prompt=GREEDY_PROMPT, max_tokens=GREEDY_TOKENS))
    assert token_ids(messages) == expected_greedy


Outcome = tuple[object, str | None]  # how a case ended (a status), and the problem with that, if any


async def run_cases(cases: list, one: Callable[[object], Awaitable[Outcome]]) -> tuple[list[str], Counter]:
    """Run ``one`` over the cases, a few at a time; the problems it reports, and how many cases ended how."""
    limit = asyncio.Semaphore(CONCURRENCY)

    async def guarded(case: object) -> Outcome:
        async with limit:
            return await one(case)

    outcomes = await asyncio.gather(*(guarded(c) for c in cases))
    return [p for _, p in outcomes if p], Counter(status for status, _ in outcomes)


def routes(model: str) -> dict[str, dict]:
    """Every HTTP route taking a JSON body, with a valid body to mutate."""
    return {
        "/v1/generate": {"prompt": "Hi", "max_tokens": 1, "stream": False},
        "/v1/completions": {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        "/tokenize": {"prompt": "Hi"},
        "/detokenize": {"tokens": [1, 2]},
        "/v1/controllers/tags": {"module_id": "0" * 64, "tags": ["fuzz.tag"]},
        "/v1/run": {"controller": "none", "controller_arg": "Hi", "max_tokens": 1},
    }


def http_problem(response: httpx.Response) -> str | None:
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} without an error body: {response.text[:300]}"
        if not isinstance(error, dict) or not error.get("message"):
            return f"{response.status_code} with a bare error: {response.text[:300]}"
    elif "internal_error" in response.text:  # a stream that failed after its 200
        return f"200 with internal_error: {response.text[:300]}"
    return None


@pytest.mark.parametrize("path", list(routes("m")))
async def test_http_json_route(stack, fuzzed, intact, path):
    rng = random.Random(f"http{path}")
    base = routes(stack.settings.served_model_name)[path]
    fields = sorted(set(FIELDS) | set(base))
    cases = [json_case(rng, base, fields) for _ in range(CASES)]
    if path == "/v1/run":  # its default is the whole context: keep a case's generation short
        cases = [_short_run(body) for body in cases]
    if path == "/v1/completions":  # every numeric sampling field at every extreme, on its own
        cases += [json.dumps({**base, field: value}).encode() for field in NUMERIC_FIELDS for value in EXTREMES]

    async with httpx.AsyncClient(base_url=f"http://{fuzzed.http}", timeout=120,
                                 headers={"content-type": "application/json"}) as http:
        async def one(body: bytes) -> Outcome:
            try:
                response = await http.post(path, content=body)
            except httpx.TransportError as exc:  # the server dropped the connection
                return "dropped", f"{body[:200]!r} -> {type(exc).__name__}: {exc}"
            problem = http_problem(response)
            return response.status_code, problem and f"{body[:200]!r} -> {problem}"

        problems, outcomes = await run_cases(cases, one)
    assert not problems, problems[:5]
    assert outcomes[400] and (outcomes[200] or path == "/v1/controllers/tags"), outcomes  # no tag's module exists


def _short_run(body: bytes) -> bytes:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if isinstance(data, dict) and not isinstance(data.get("max_tokens"), int | float):
        data["max_tokens"] = 1
        return json.dumps(data).encode("utf-8", "surrogatepass")
    return body


async def test_module_upload(fuzzed, intact):
    rng = random.Random("upload")
    controller = (ROOT / "controllers" / "wasm" / "yesno.wasm").read_bytes()
    cases = [wasm_case(rng, controller) for _ in range(CASES)]
    async with httpx.AsyncClient(base_url=f"http://{fuzzed.http}", timeout=120) as http:
        async def one(module: bytes) -> Outcome:
            response = await http.post("/v1/controllers", content=module)
            problem = http_problem(response)
            if problem is None and response.status_code == 200 and "module_id" not in response.json():
                problem = f"200 without a module id: {response.text[:200]}"
            return response.status_code, problem and f"{module[:80]!r} -> {problem}"

        problems, outcomes = await run_cases(cases, one)
    assert not problems, problems[:5]
    assert outcomes[200] and outcomes[400], outcomes


def ws_frames(rng: random.Random) -> list[bytes]:
    config = {"type": "config", "prompt": "Hi", "parameters": {"max_tokens": 1, "temperature": 0}}
    control = {"type": "stop"}
    frames = []
    for _ in range(CASES):
        base = config if rng.random() < 0.7 else dict(control, type=rng.choice(
            ["stop", "pause", "resume", "modify", "regenerate", "feedback"]))
        frames.append(json_case(rng, base, sorted(set(FIELDS) | set(base))))
    return frames


async def test_websocket(fuzzed, intact):
    frames = ws_frames(random.Random("websocket"))
    connections = [frames[i::CONCURRENCY] for i in range(CONCURRENCY)]

    outcomes: Counter = Counter()

    async def connection(frames: list[bytes]) -> list[str]:
        problems = []
        async with websockets.connect(f"ws://{fuzzed.http}/generate") as ws:
            for frame in frames:
                await ws.send(frame.decode() if is_utf8(frame) else frame)
                while True:  # up to the frame's last answer: a completion, an error, or an acknowledgement
                    message = await receive(ws)
                    if message["type"] == "error" and message["error"] == "internal_error":
                        problems.append(f"{frame[:200]!r} -> {message}")
                    if message["type"] in FINAL or (message["type"] == "status"
                                                    and message.get("operation") != "model_loading"):
                        outcomes[message["type"]] += 1
                        break
        return problems

    problems = [p for found in await asyncio.gather(*(connection(c) for c in connections)) for p in found]
    assert not problems, problems[:5]
    assert outcomes["completion"] and outcomes["error"], outcomes


def is_utf8(frame: bytes) -> bool:
    """Frames whose bytes are UTF-8 go as text frames, the others as binary ones (both carry JSON)."""
    try:
        frame.decode()
    except UnicodeDecodeError:
        return False
    return True


async def test_salience(stack, fuzzed, intact):
    rng = random.Random("salience")
    async with grpc.aio.insecure_channel(fuzzed.grpc) as channel:
        stub = pb_grpc.SalienceStub(channel)
        model = stack.settings.served_model_name
        sessions = [(await stub.OpenSession(pb.OpenSessionRequest(model=model))).session_id for _ in range(3)]
        fuzzer = ProtoFuzzer(rng, {"session_id": [*sessions, *sessions, "", "nope"], "model": [model, "other"],
                                   "offset": [0, 0, 1, 2, 5, 2**31], "append_tokens": [1, 2, 3, 100, 2**31],
                                   "mime": ["image/png", "", "x"]})
        methods = {m.name: m for m in pb.DESCRIPTOR.services_by_name["Salience"].methods}
        weights = {"Generate": 10, "OpenSession": 1, "ForkSession": 1, "DumpSession": 1, "CloseSession": 1,
                   "GetReadoutManifest": 1}
        names = rng.choices(list(weights), weights=list(weights.values()), k=CASES)
        cases = [(name, fuzzer.case(GetMessageClass(methods[name].input_type))) for name in names]

        async def one(case: tuple[str, bytes]) -> Outcome:
            name, data = case
            method = methods[name]
            path = f"/{method.containing_service.full_name}/{name}"
            kind = channel.unary_stream if method.server_streaming else channel.unary_unary
            code, details = await call_status(kind(path)(data, timeout=120))
            return code, f"{name} {data[:120]!r} -> {code.name} {details}" if code in SERVER_FAULTS else None

        problems, outcomes = await run_cases(cases, one)
    assert not problems, problems[:5]
    assert outcomes[grpc.StatusCode.OK] and outcomes[grpc.StatusCode.INVALID_ARGUMENT], outcomes


async def test_evergreen(fuzzed, intact):
    rng = random.Random("evergreen")
    fuzzer = ProtoFuzzer(rng, {
        "id": ["p", "r", "q", ""], "name": ["GENERATE", "TRY_GENERATE", "DROP", "SET_TTL", "CANCEL", "prompt",
                                            "response", "node", "error", "x"],
        "mimetype": ["text/plain", "application/json", "video/mp4", "application/x-protobuf;type=EndOfTurn", ""],
        "role": ["user", "assistant", "system", "x", ""], "data": [b"Hi", b"Hello there", b"\xff", b""],
        "child_ids": ["p", "q", "r"], "ref": ["", "x", "file:///etc/hostname", "data:,hi"], "seq": [0, 0, 1, 2, -1],
        "config_keys": ["max_tokens", "temperature", "stop", "ttl_s", "top_p", "seed", "x"],
    })
    cases = [[fuzzer.case(eg.SessionMessage) for _ in range(rng.randint(1, 3))] for _ in range(CASES)]
    async with grpc.aio.insecure_channel(fuzzed.grpc) as channel:
        start = channel.stream_stream("/evergreen.v2.EvergreenService/StartSession")

        async def one(messages: list[bytes]) -> Outcome:
            async def requests() -> AsyncIterator[bytes]:
                for m in messages:
                    yield m

            code, details = await call_status(start(requests(), timeout=120))
            return code, f"{[m[:80] for m in messages]!r} -> {code.name} {details}" if code in SERVER_FAULTS else None

        problems, outcomes = await run_cases(cases, one)
    assert not problems, problems[:5]
    assert outcomes[grpc.StatusCode.OK] and outcomes[grpc.StatusCode.INVALID_ARGUMENT], outcomes
