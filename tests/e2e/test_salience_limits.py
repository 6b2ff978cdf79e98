"""Salience on a stack of its own with tight session settings: bearer-token auth on every RPC,
a short idle TTL, and a KV budget for idle sessions so small that turns of two sessions keep
evicting each other's KV (which must never change what they generate)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from common.model_source import load_tokenizer
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from tests.e2e.test_salience import RPC_TIMEOUT_S, generate, greedy, status_of
from tests.stack import Stack, start_stack

TOKEN = "s3cret-token"
TTL_S = 12.0  # long enough for a few turns on a busy 2-core machine
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PARKED_FRACTION = 0.006  # of a 4 x 2048-token KV pool: about one 50-token session


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = start_stack(
        tmp_path_factory.mktemp("salience-limits"),
        TILLER_SESSIONS__AUTH_TOKEN=TOKEN,
        TILLER_SESSIONS__TTL_S=str(TTL_S),
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


async def test_idle_sessions_expire_and_any_call_refreshes_them(tight, stub) -> None:
    idle = await open_session(stub, tight)
    kept = await open_session(stub, tight)
    await generate(stub, AUTH, session_id=kept, append_tokens=[5, 6], offset=0, max_tokens=0)
    for _ in range(2):  # 1.2 TTLs in all, with a refresh every 0.6 TTL
        await asyncio.sleep(TTL_S * 0.6)
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
