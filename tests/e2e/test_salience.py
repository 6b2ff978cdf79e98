"""Salience (seed 002) end to end: a grpcio client generated from salience.proto on the real stack.

Greedy decoding is asked for the proto's way (top_k=1; temperature 0 means the default 1.0) and
compared with transformers greedy; prompt logprobs and logit-lens readouts are compared with
transformers' own forward pass at the same positions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch

from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from services.gateway.salience.service import CACHED_TOKENS_TRAILER
from tests.gateway.support import wait_for

RPC_TIMEOUT_S = 120.0
Done = pb.GenerateDone


@dataclass
class Result:
    tokens: list[pb.Token]
    done: pb.GenerateDone
    trailers: dict[str, str]

    @property
    def decoded(self) -> list[int]:
        return [t.id for t in self.tokens if not t.is_prefill]

    @property
    def prefill(self) -> list[pb.Token]:
        return [t for t in self.tokens if t.is_prefill]


async def generate(stub: pb_grpc.SalienceStub, metadata: tuple = (), **fields) -> Result:
    call = stub.Generate(pb.GenerateRequest(**fields), timeout=RPC_TIMEOUT_S, metadata=metadata)
    tokens, done = [], None
    async for event in call:
        assert done is None, "no event may follow Done"
        if event.HasField("token"):
            tokens.append(event.token)
        else:
            done = event.done
    assert done is not None, "the stream ended without Done"
    trailers = {k: v for k, v in (await call.trailing_metadata() or ())}
    return Result(tokens, done, trailers)


def greedy(**fields) -> dict:
    return {"top_k": 1, **fields}


async def status_of(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code(), info.value.details()


@pytest.fixture(scope="module")
async def channel(stack) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as chan:
        yield chan


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.SalienceStub:
    return pb_grpc.SalienceStub(channel)


@pytest.fixture(scope="module")
def model_name(stack) -> str:
    return stack.settings.served_model_name


async def open_session(stub, model_name: str) -> str:
    reply = await stub.OpenSession(pb.OpenSessionRequest(model=model_name), timeout=RPC_TIMEOUT_S)
    assert reply.session_id and reply.max_model_len > 0
    return reply.session_id


async def dump(stub, session_id: str) -> list[int]:
    return list((await stub.DumpSession(pb.DumpSessionRequest(session_id=session_id))).tokens)


def encode(stack, text: str) -> list[int]:
    return stack.tokenizer.encode(text)


# -- conversation, fork, dump -------------------------------------------------------------------


async def test_open_generate_fork_generate_dump(stack, stub, model_name, hf_greedy) -> None:
    session = await open_session(stub, model_name)
    prompt = encode(stack, "The capital of France is")
    first = await generate(stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=6, **greedy())
    assert first.decoded == hf_greedy(prompt, 6)
    assert [t.position for t in first.tokens] == list(range(len(prompt), len(prompt) + 6))
    assert first.done.finish_reason == Done.FINISH_REASON_LENGTH
    assert (first.done.prompt_tokens, first.done.completion_tokens, first.done.total_tokens) == (len(prompt), 6, len(prompt) + 6)
    history = prompt + first.decoded
    assert await dump(stub, session) == history

    # second turn: only the delta travels, and only it (plus the unfed last token) is computed
    more = encode(stack, " And Italy's is")
    second = await generate(stub, session_id=session, append_tokens=more, offset=len(history), max_tokens=5, **greedy())
    assert second.decoded == hf_greedy(history + more, 5)
    assert int(second.trailers[CACHED_TOKENS_TRAILER]) >= len(history) - 1, second.trailers
    history += more + second.decoded
    assert await dump(stub, session) == history

    # fork at the end of the first turn: both branches go on from there, each on its own
    at = len(prompt) + 6
    fork = (await stub.ForkSession(pb.ForkSessionRequest(session_id=session, at_position=at))).session_id
    assert await dump(stub, fork) == history[:at]
    other = stack.tokenizer.encode(" Then", add_special_tokens=False)
    branch = await generate(stub, session_id=fork, append_tokens=other, offset=at, max_tokens=4, **greedy())
    assert branch.decoded == hf_greedy(history[:at] + other, 4)
    assert int(branch.trailers[CACHED_TOKENS_TRAILER]) > 0  # the parent's KV, shared copy-on-write
    main = await generate(stub, session_id=session, append_tokens=other, offset=len(history), max_tokens=4, **greedy())
    assert main.decoded == hf_greedy(history + other, 4)
    assert await dump(stub, fork) == history[:at] + other + branch.decoded
    assert await dump(stub, session) == history + other + main.decoded
