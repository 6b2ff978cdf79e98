"""Soak: 32 concurrent streams across the surfaces for N minutes on a stack of its own.

Each of ``--streams`` clients loops over one surface (WebSocket, OpenAI SSE completions, OpenAI SSE chat,
Salience Generate on a session of its own, Evergreen GENERATE), one request after another, each of
``--tokens`` greedy tokens. Printed: per minute, requests ended, errors and generated tokens/s (streamed
tokens; Evergreen counts its response fragments); then each
service's resident memory (RSS) at the start, after the first minute (warmed up) and at the end.

    OMP_NUM_THREADS=1 python deploy/loadtest/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.protos.evergreen.v2 import evergreen_pb2_grpc as eg_grpc  # noqa: E402
from common.protos.salience.v1 import salience_pb2 as pb  # noqa: E402
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc  # noqa: E402
from tests.e2e.test_evergreen import config, generate, msg, text  # noqa: E402
from tests.gateway.support import ws_generate  # noqa: E402
from tests.stack import Stack, start_stack  # noqa: E402

SERVICES = ("gateway", "scheduler", "worker", "session_store", "controller_runtime")
SURFACES = ("ws", "completions", "chat", "salience", "evergreen")
PROMPT = "Tell me a story about a lighthouse keeper and"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Tally:
    """Requests, errors and tokens per minute since the start (requests ending after the last minute, while
    the clients wind down, count in it)."""

    def __init__(self, minutes: float) -> None:
        self.start = time.monotonic()
        self.last = max(0, math.ceil(minutes) - 1)
        self.rows: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # minute -> requests, errors, tokens
        self.errors: dict[str, int] = defaultdict(int)

    def add(self, tokens: int, error: str = "") -> None:
        row = self.rows[min(self.last, int((time.monotonic() - self.start) // 60))]
        row[0] += 1
        row[1] += bool(error)
        row[2] += tokens
        if error:
            self.errors[error[:120]] += 1


async def ws_request(stack: Stack, tokens: int, _: dict) -> int:
    last = (await ws_generate(stack.ws_url, {"prompt": PROMPT, "parameters": {
        "max_tokens": tokens, "temperature": 0, "ignore_eos": True}}))[-1]
    if last["type"] == "error":
        raise RuntimeError(f"ws {last['error']}: {last['message']}")
    return int(last["usage"]["completion_tokens"])


async def sse_request(stack: Stack, tokens: int, state: dict, *, chat: bool) -> int:
    body = {"model": stack.settings.served_model_name, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    http: httpx.AsyncClient = state.setdefault("http", httpx.AsyncClient(base_url=stack.http_url, timeout=300))
    chunks = 0
    async with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return chunks
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"sse {event['error'].get('code')}: {event['error'].get('message')}")
                chunks += sum(1 for c in event.get("choices", []) if c.get("text") or c.get("delta", {}).get("content"))
    raise RuntimeError("sse ended without [DONE]")


async def salience_request(stack: Stack, tokens: int, state: dict) -> int:
    channel = state.setdefault("channel", grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}"))
    stub = pb_grpc.SalienceStub(channel)
    if "session" not in state:
        state["session"] = (await stub.OpenSession(pb.OpenSessionRequest(model=stack.settings.served_model_name))).session_id
        state["prompt"] = stack.tokenizer.encode(PROMPT)
    call = stub.Generate(pb.GenerateRequest(session_id=state["session"], offset=0, truncating=True,
                                            append_tokens=state["prompt"], max_tokens=tokens, top_k=1), timeout=300)
    decoded = 0
    async for event in call:
        decoded += event.HasField("token") and not event.token.is_prefill
    return decoded


async def evergreen_request(stack: Stack, tokens: int, state: dict) -> int:
    channel = state.setdefault("channel", grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}"))
    done = asyncio.Event()

    async def messages():
        yield msg(text("p", PROMPT, role="user"), generate("p", "r", configs=(config(max_tokens=tokens, temperature=0),)))
        await done.wait()

    fragments = 0
    async for m in eg_grpc.EvergreenServiceStub(channel).StartSession(messages(), timeout=300):
        response = [f for f in m.node_fragments if f.id == "r"]
        fragments += len(response)
        if any(not f.continued for f in response):
            done.set()
    return fragments


REQUESTS: dict[str, Callable[[Stack, int, dict], Awaitable[int]]] = {
    "ws": ws_request,
    "completions": lambda s, t, st: sse_request(s, t, st, chat=False),
    "chat": lambda s, t, st: sse_request(s, t, st, chat=True),
    "salience": salience_request,
    "evergreen": evergreen_request,
}


async def client(stack: Stack, surface: str, tokens: int, until: float, tally: Tally) -> None:
    state: dict = {}
    while time.monotonic() < until:
        try:
            tally.add(await REQUESTS[surface](stack, tokens, state))
        except Exception as exc:  # counted, and the client goes on
            tally.add(0, f"{surface}: {exc!r}")
            await asyncio.sleep(0.5)


async def soak(stack: Stack, streams: int, minutes: float, tokens: int, pids: dict[str, int]) -> tuple[Tally, dict]:
    """Run the clients; also the services' RSS once the first minute warmed them up."""
    tally = Tally(minutes)
    until = tally.start + minutes * 60
    warm: dict[str, float] = {}

    async def sample_warm() -> None:
        await asyncio.sleep(min(60.0, minutes * 30))
        warm.update({name: rss_mib(pid) for name, pid in pids.items()})

    await asyncio.gather(sample_warm(), *(client(stack, SURFACES[i % len(SURFACES)], tokens, until, tally)
                                          for i in range(streams)))
    return tally, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    args = parser.parse_args()
    from common.model_source import load_tokenizer

    stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-soak-")))
    stack.tokenizer = load_tokenizer(stack.settings)
    try:
        pids = {name: stack.pid(name) for name in SERVICES}
        before = {name: rss_mib(pid) for name, pid in pids.items()}
        tally, warm = asyncio.run(soak(stack, args.streams, args.minutes, args.tokens, pids))
        after = {name: rss_mib(pid) for name, pid in pids.items()}
        restarted = [name for name in SERVICES if stack.pid(name) != pids[name]]
    finally:
        stack.down()
    print(f"{args.streams} streams over {', '.join(SURFACES)}, {args.tokens} greedy tokens a request, "
          f"{args.minutes:g} minutes")
    print("| minute | requests | errors | tokens/s |")
    print("|---|---|---|---|")
    for minute in sorted(tally.rows):
        requests, errors, tokens = tally.rows[minute]
        print(f"| {minute + 1} | {requests} | {errors} | {tokens / 60:.1f} |")
    print("\n| service | RSS start (MiB) | after the first minute | RSS end (MiB) | end vs start | end vs first minute |")
    print("|---|---|---|---|---|---|")
    for name in SERVICES:
        print(f"| {name} | {before[name]:.0f} | {warm[name]:.0f} | {after[name]:.0f} | "
              f"{(after[name] / before[name] - 1) * 100:+.1f}% | {(after[name] / warm[name] - 1) * 100:+.1f}% |")
    print(f"\nrestarted during the soak: {', '.join(restarted) or 'none'}")
    for error, n in sorted(tally.errors.items(), key=lambda e: -e[1])[:10]:
        print(f"error x{n}: {error}")


if __name__ == "__main__":
    main()
