"""Salience on a stack of its own with tight session settings: bearer-token auth on every RPC,
priority with every batch slot taken, and a KV budget for idle sessions so small that turns of two
sessions keep evicting each other's KV (which must never change what they generate); and an extra
session store and gateway on that stack's scheduler with a short idle TTL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from common.model_source import load_tokenizer
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from tests.e2e.test_salience import RPC_TIMEOUT_S, generate, greedy, status_of
from tests.gateway.support import base_env, service, wait_for
from tests.stack import Stack, free_port, start_stack

TOKEN = "s3cret-token"
TTL_S = 3.0
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PARKED_FRACTION = 0.01  # of a 4 x 2048-token KV pool: one session of these (~60 tokens), not two


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = start_stack(
        tmp_path_factory.mktemp("salience-limits"),
        TILLER_SESSIONS__AUTH_TOKEN=TOKEN,
        TILLER_SESSIONS__KV_PARKED_FRACTION=str(PARKED_FRACTION),
        TILLER_LIMITS__MAX_BATCH_SIZE="4",  # a KV pool of 4 x 2048 tokens
    )
    started.tokenizer = load_tokenizer(started.settings)
    yield started
    started.down()


@pytest.fixture(scope="module")
async def stub(tight: Stack) -> AsyncIterator[pb_grpc.SalienceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{tight.settings.grpc_port}") as channel:
        yield pb_grpc.SalienceStub(channel)


@pytest.fixture(scope="module")
async def short_ttl(tight: Stack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[pb_grpc.SalienceStub]:
    """A session store with a short TTL, and a gateway using it, on the tight stack's scheduler."""
    run_dir = tmp_path_factory.mktemp("salience-ttl")
    port = free_port()
    env = base_env(run_dir, TILLER_SCHEDULER_ENDPOINT=tight.settings.endpoint("scheduler"),
                   TILLER_SESSIONS__TTL_S=str(TTL_S), TILLER_SESSIONS__AUTH_TOKEN=TOKEN,
                   TILLER_HTTP_PORT=str(free_port()), TILLER_GRPC_PORT=str(port))
    with service("services.session_store", env, run_dir / "session_store.log"), \
            service("services.gateway", env, run_dir / "gateway.log"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SalienceStub(channel)

            async def up() -> bool:
                try:
                    await stub.GetReadoutManifest(pb.GetReadoutManifestRequest(), metadata=AUTH, timeout=2)
                    return True
                except grpc.aio.AioRpcError:
                    return False

            await wait_for(up, 120, "the short-TTL gateway")
            yield stub


async def open_session(stub, tight: Stack) -> str:
    reply = await stub.OpenSession(pb.OpenSessionRequest(model=tight.settings.served_model_name), metadata=AUTH,
                                   timeout=RPC_TIMEOUT_S)
    return reply.session_id


async def test_every_rpc_needs_the_bearer_token(tight, stub) -> None:
    session = await open_session(stub, tight)
    model = tight.settings.served_model_name
    calls = {
        "OpenSession": lambda md: stub.OpenSession(pb.OpenSessionRequest(model=model), metadata=md),
        "CloseSession": lambda md: stub.CloseSession(pb.CloseSessionRequest(session_id="sess-x"), metadata=md),
        "ForkSession": lambda md: stub.ForkSession(pb.ForkSessionRequest(session_id=session), metadata=md),
        "DumpSession": lambda md: stub.DumpSession(pb.DumpSessionRequest(session_id=session), metadata=md),
        "GetReadoutManifest": lambda md: stub.GetReadoutManifest(pb.GetReadoutManifestRequest(), metadata=md),
        "Generate": lambda md: generate(stub, md, session_id=session, append_tokens=[1], offset=0, max_tokens=0),
    }
    for name, call in calls.items():
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            code, details = await status_of(call(metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, metadata, details)
        await call(AUTH)  # the right token passes
    assert list((await stub.DumpSession(pb.DumpSessionRequest(session_id=session), metadata=AUTH)).tokens) == [1]


async def test_idle_sessions_expire_and_any_call_refreshes_them(tight, short_ttl) -> None:
    stub = short_ttl
    idle = await open_session(stub, tight)
    kept = await open_session(stub, tight)
    await generate(stub, AUTH, session_id=kept, append_tokens=[5, 6], offset=0, max_tokens=0)
    for _ in range(4):  # 1.6 TTLs in all, with a refresh every 0.4 TTL
        await asyncio.sleep(TTL_S * 0.4)
        await generate(stub, AUTH, session_id=kept, offset=2, max_tokens=0)  # the proto's no-op refresh
    code, details = await status_of(stub.DumpSession(pb.DumpSessionRequest(session_id=idle), metadata=AUTH))
    assert code == grpc.StatusCode.NOT_FOUND and "expired" in details
    assert list((await stub.DumpSession(pb.DumpSessionRequest(session_id=kept), metadata=AUTH)).tokens) == [5, 6]
    await asyncio.sleep(TTL_S + 1.0)
    code, _ = await status_of(generate(stub, AUTH, session_id=kept, offset=2, max_tokens=0))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_evicted_kv_is_recomputed_and_never_changes_a_session(tight, stub, hf_greedy) -> None:
    tokenizer = tight.tokenizer
    sessions = {name: await open_session(stub, tight) for name in ("a", "b")}
    # each session alone is about as large as the idle-KV budget
    history = {
        "a": tokenizer.encode("Apples are red or green fruits that grow on trees in orchards across the temperate "
                              "world, and people eat them raw, baked in pies, or pressed into cider. Apples are"),
        "b": tokenizer.encode("Bananas are long yellow fruits that grow in large hanging bunches on tall plants in "
                              "warm tropical countries, and people eat them raw or in bread. Bananas are"),
    }
    sent = {name: 0 for name in sessions}
    for turn in range(3):
        for name, session in sessions.items():
            append = history[name][sent[name]:] if turn == 0 else tokenizer.encode(f" and {turn}")
            if turn:
                history[name] += append
            result = await generate(stub, AUTH, session_id=session, append_tokens=append, offset=sent[name],
                                    max_tokens=5, **greedy())
            assert result.decoded == hf_greedy(history[name], 5), (name, turn)
            history[name] += result.decoded
            sent[name] = len(history[name])
            dumped = (await stub.DumpSession(pb.DumpSessionRequest(session_id=session), metadata=AUTH)).tokens
            assert list(dumped) == history[name]
    health = await asyncio.to_thread(tight.scheduler_health)
    # the budget held: the last turn's session kept its KV, the other one's was let go
    assert health["parked_sessions"] == 1, health
    assert health["parked_tokens"] <= PARKED_FRACTION * health["kv_capacity_tokens"] < 2 * health["parked_tokens"]


async def test_priority_orders_the_queue(tight, stub) -> None:
    """With every batch slot taken, a waiting interactive turn (priority 0) starts before a batch
    turn (priority 10) that was queued earlier."""
    prompt = tight.tokenizer.encode("Count from one to one hundred: one, two, three, four,")
    started: dict[str, float] = {}

    async def turn(name: str, max_tokens: int, priority: int) -> None:
        session = await open_session(stub, tight)
        request = pb.GenerateRequest(session_id=session, append_tokens=prompt, offset=0, max_tokens=max_tokens,
                                     priority=priority, top_k=1)
        async for event in stub.Generate(request, metadata=AUTH, timeout=RPC_TIMEOUT_S):
            if event.HasField("token") and not event.token.is_prefill:
                started.setdefault(name, asyncio.get_running_loop().time())

    slots = tight.settings.limits.max_batch_size
    blockers = [asyncio.ensure_future(turn(f"blocker{i}", 24 * (i + 1), 5)) for i in range(slots)]
    while len(started) < slots:  # every slot is busy, each freeing at its own time
        await asyncio.sleep(0.05)
    batch = asyncio.ensure_future(turn("batch", 2, 10))
    await asyncio.sleep(0.3)  # queued first
    interactive = asyncio.ensure_future(turn("interactive", 2, 0))
    await asyncio.gather(*blockers, batch, interactive)
    assert started["interactive"] < started["batch"], started
