"""Two gateway processes on one port (``distributed.gateways`` = 2, as ``tiller up --gateways 2`` sets it), with
real clients (httpx, the openai package, grpc): both serve HTTP and gRPC, the rate limit holds across them, a
restart goes one process at a time, and a gateway killed with SIGKILL loses only its own streams, which the
scheduler cancels (no KV stays held).

A client learns which process serves it by asking ``/health`` (its ``pid``) on the one connection its later
requests reuse (``max_connections=1``): the kernel picks a process per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections import Counter

import grpc
import httpx
import openai
import pytest

from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from tests.gateway.support import wait_for
from tests.stack import Stack, start_stack

RATE_LIMIT = 12  # requests per minute and user
SILENCE_S = 3.0  # limits.gateway_silence_s: the scheduler gives up a silent gateway's requests after this
TOKENS = {"t-serve": "serve", "t-rate": "rate", "t-kill": "kill"}  # a user per test: each its own rate window
LONG = 1800  # tokens a stream on the killed gateway asks for: far from done when the scheduler cancels it
SHORT = 24  # tokens a stream on the surviving one asks for


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    stack = start_stack(tmp_path_factory.mktemp("gateways"), TILLER_DISTRIBUTED__GATEWAYS="2",
                        TILLER_LIMITS__GATEWAY_SILENCE_S=str(SILENCE_S),
                        TILLER_LIMITS__RATE_LIMIT_PER_MINUTE=str(RATE_LIMIT),
                        TILLER_API_AUTH__TOKENS=json.dumps(TOKENS))
    yield stack
    stack.down()


def gateway_pids(stack: Stack) -> set[int]:
    return {stack.pid("gateway"), stack.pid("gateway_1")}


def identity(pid: int) -> str:
    return f"gateway-{socket.gethostname()}-{pid}"


def pinned(stack: Stack, token: str) -> tuple[httpx.Client, int]:
    """A client on one connection, and the pid of the gateway process that connection reached."""
    client = httpx.Client(base_url=stack.http_url, limits=httpx.Limits(max_connections=1), timeout=60,
                          headers={"Authorization": f"Bearer {token}"})
    return client, client.get("/health").json()["pid"]


def one_on_each(stack: Stack, token: str) -> dict[int, httpx.Client]:
    """A pinned client on each gateway process."""
    clients: dict[int, httpx.Client] = {}
    for _ in range(64):  # each connection reaches either process: both are found within a few
        client, pid = pinned(stack, token)
        if pid in clients:
            client.close()
        else:
            clients[pid] = client
        if len(clients) == 2:
            return clients
    raise AssertionError(f"64 connections all reached {set(clients)}")


def complete(stack: Stack, client: httpx.Client, token: str, max_tokens: int = 2) -> str:
    oai = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key=token, http_client=client, max_retries=0)
    reply = oai.completions.create(model=stack.settings.served_model_name, prompt="Hello", max_tokens=max_tokens)
    return reply.choices[0].finish_reason


def test_both_processes_serve_the_port_and_are_peers_of_the_scheduler(gateways: Stack):
    clients = one_on_each(gateways, "t-serve")
    assert set(clients) == gateway_pids(gateways)  # the gateways supervisord started, both answering
    for client in clients.values():
        assert complete(gateways, client, "t-serve") == "length"
        client.close()
    peers = gateways.scheduler_health()["gateways"]
    assert sorted(p["gateway"] for p in peers) == sorted(identity(pid) for pid in gateway_pids(gateways))
    assert len({p["incarnation"] for p in peers}) == 2  # each its own life
    logs = [gateways.run_dir / "logs" / f"{name}.log" for name in ("gateway", "gateway_1")]
    assert all('"gateway.ready"' in log.read_text() for log in logs)  # a log file per process
    status = gateways._cli("status").stdout.split()
    assert status[status.index("gateway") + 1] == status[status.index("gateway_1") + 1] == "RUNNING"


def test_the_rate_limit_holds_across_processes(gateways: Stack):
    answers: Counter[tuple[int, int]] = Counter()  # (pid, HTTP status) -> how many
    for _ in range(RATE_LIMIT + 6):
        client, pid = pinned(gateways, "t-rate")
        with contextlib.closing(client):
            status = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code
        answers[pid, status] += 1
    assert {pid for pid, _ in answers} == gateway_pids(gateways), answers  # both counted this user's requests
    assert sum(n for (_, status), n in answers.items() if status == 200) == RATE_LIMIT, answers
    assert sum(n for (_, status), n in answers.items() if status == 429) == 6, answers
    client, _ = pinned(gateways, "t-serve")  # another user has a window of its own
    with contextlib.closing(client):
        assert complete(gateways, client, "t-serve") == "length"


async def test_grpc_shares_the_port_too_and_a_session_outlives_the_process_that_opened_it(gateways: Stack):
    """Salience sessions opened on separate connections (a local subchannel pool each: grpc would share one)
    land on both processes (their logs), and each is found from any other connection."""

    async def on_a_connection_of_its_own(call):
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateways.settings.grpc_port}", options=options) as channel:
            return await call(pb_grpc.SalienceStub(channel))

    model = gateways.settings.served_model_name
    opened = [(await on_a_connection_of_its_own(
        lambda stub: stub.OpenSession(pb.OpenSessionRequest(model=model), timeout=30))).session_id for _ in range(16)]
    logs = {name: (gateways.run_dir / "logs" / f"{name}.log").read_text() for name in ("gateway", "gateway_1")}
    assert all(any(session in log for session in opened) for log in logs.values()), "one process opened them all"
    for session in opened:
        dumped = await on_a_connection_of_its_own(lambda stub: stub.DumpSession(pb.DumpSessionRequest(
            session_id=session), timeout=30))
        assert list(dumped.tokens) == []
        await on_a_connection_of_its_own(lambda stub: stub.CloseSession(pb.CloseSessionRequest(session_id=session)))


def test_a_restart_of_the_gateways_goes_one_at_a_time_so_the_port_keeps_serving(gateways: Stack):
    before = gateway_pids(gateways)
    answers: list[int | None] = []  # the pid that answered, None: no answer
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                answers.append(httpx.get(f"{gateways.http_url}/health", timeout=5).json()["pid"])
            except httpx.HTTPError:
                answers.append(None)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = gateways._cli("restart", "gateway", check=False)
    finally:
        done.set()
        poller.join()
    assert result.returncode == 0 and result.stdout.index("gateway: started") < result.stdout.index(
        "gateway_1: stopped"), result
    after = gateway_pids(gateways)
    assert not after & before
    # a connection the kernel had queued at the closing socket of a stopping gateway may be reset (SO_REUSEPORT
    # does not move it to the other listener): nearly every poll is answered, and by a new pid at the end
    assert answers.count(None) <= 2 and len(answers) > 20, answers
    assert answers[-1] in after


async def stream_on(stack: Stack, client: httpx.Client, max_tokens: int) -> tuple[openai.AsyncStream, object]:
    """A streamed completion on ``client``'s connection, its first chunk read."""
    oai = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="t-kill", http_client=client, max_retries=0)
    stream = await oai.completions.create(model=stack.settings.served_model_name, prompt="Once upon a time",
                                          max_tokens=max_tokens, temperature=0, stream=True)
    chunks = stream.__aiter__()
    return stream, await chunks.__anext__()


async def pinned_async(stack: Stack) -> tuple[httpx.AsyncClient, int]:
    client = httpx.AsyncClient(base_url=stack.http_url, limits=httpx.Limits(max_connections=1), timeout=120,
                               headers={"Authorization": "Bearer t-kill"})
    return client, (await client.get("/health")).json()["pid"]


async def test_a_killed_gateway_loses_only_its_own_streams_and_the_scheduler_cancels_them(gateways: Stack):
    victim, survivor = gateways.pid("gateway"), gateways.pid("gateway_1")
    clients: dict[int, list[httpx.AsyncClient]] = {victim: [], survivor: []}
    for _ in range(64):
        client, pid = await pinned_async(gateways)
        if len(clients[pid]) < 2:
            clients[pid].append(client)
        else:
            await client.aclose()
        if all(len(c) == 2 for c in clients.values()):
            break
    assert all(len(c) == 2 for c in clients.values()), clients
    doomed = [await stream_on(gateways, c, LONG) for c in clients[victim]]
    kept = [await stream_on(gateways, c, SHORT) for c in clients[survivor]]
    health = await asyncio.to_thread(gateways.scheduler_health)
    lines = {p["gateway"]: p["requests"] for p in health["gateways"]}
    assert lines[identity(victim)] == 2 and lines[identity(survivor)] == 2, lines

    os.kill(victim, signal.SIGKILL)

    for stream, _ in doomed:  # their connection died with the process
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
    for stream, _first in kept:  # the other process's streams run to their end
        finishes = [chunk.choices[0].finish_reason async for chunk in stream]
        assert finishes[-1] == "length"
    for _ in range(3):  # and new clients are served (by the survivor, or the restarted gateway once it listens)
        client, _pid = pinned(gateways, "t-kill")
        with contextlib.closing(client):
            assert complete(gateways, client, "t-kill") == "length"

    async def cancelled() -> bool:  # LONG tokens take far longer than this wait: the scheduler ended them
        health = await asyncio.to_thread(gateways.scheduler_health)
        named = {p["gateway"] for p in health["gateways"]}
        return identity(victim) not in named and health["running"] == 0 and health["kv_used_tokens"] == 0

    await wait_for(cancelled, SILENCE_S + 10, "the scheduler to cancel the killed gateway's streams")
    lost = [json.loads(line) for line in (gateways.run_dir / "logs" / "scheduler.log").read_text().splitlines()
            if '"scheduler.gateway_lost"' in line]
    assert [(entry["gateway"], entry["requests"]) for entry in lost] == [(identity(victim), 2)]
    for client in clients[survivor] + clients[victim]:
        await client.aclose()
