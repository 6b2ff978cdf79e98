"""Salience end to end: a grpcio client generated from salience.proto on the real stack.

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
from common.sockets import probe_health
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


async def dump_once_the_store_is_back(stub, session_id: str) -> list[int]:
    """DumpSession once the session store answers again (UNAVAILABLE until then)."""
    async def dumped() -> list[int] | None:
        try:
            return await dump(stub, session_id)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            return None

    await wait_for(dumped, 60, "the session store to come back")
    return await dump(stub, session_id)


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


# -- offsets ------------------------------------------------------------------------------------


async def test_offset_drift_and_truncating_rewrite(stack, stub, model_name, hf_greedy) -> None:
    session = await open_session(stub, model_name)
    prompt = encode(stack, "One, two, three, four,")
    turn = await generate(stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=4, **greedy())
    length = len(prompt) + 4
    for offset, truncating in ((length - 1, False), (length + 1, False), (length + 1, True), (0, False)):
        code, details = await status_of(
            generate(stub, session_id=session, append_tokens=[1], offset=offset, truncating=truncating, max_tokens=1)
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (offset, truncating, details)
        assert f"offset {offset}" in details
    assert await dump(stub, session) == prompt + turn.decoded  # refused calls changed nothing

    # rewrite history: drop the generated tokens and the last prompt token, append something else
    keep = len(prompt) - 1
    rewrite = encode(stack, " five")
    again = await generate(stub, session_id=session, append_tokens=rewrite, offset=keep, truncating=True,
                           max_tokens=3, **greedy())
    assert again.decoded == hf_greedy(prompt[:keep] + rewrite, 3)
    assert await dump(stub, session) == prompt[:keep] + rewrite + again.decoded
    # truncating=true with offset equal to the length is a plain append
    tail = await generate(stub, session_id=session, offset=keep + len(rewrite) + 3, truncating=True, max_tokens=0)
    assert tail.done.finish_reason == Done.FINISH_REASON_LENGTH and not tail.tokens


# -- scoring, logprobs, readouts ----------------------------------------------------------------


def reference_forward(hf_model, tokens: list[int]):
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens]), output_hidden_states=True)


async def test_scoring_logprobs_equal_transformers(stack, stub, model_name, hf_model) -> None:
    session = await open_session(stub, model_name)
    tokens = encode(stack, "Scoring a sentence: the quick brown fox jumps over the lazy dog, twice over.")
    n = len(tokens)
    # first call warms the session's KV; the second asks about early positions it holds, with top-k
    await generate(stub, session_id=session, append_tokens=tokens[:-3], offset=0, max_tokens=0)
    scored = await generate(
        stub, session_id=session, append_tokens=tokens[-3:], offset=n - 3, max_tokens=0, logprob_top_k=3,
        logprobs_ranges=[pb.PositionRange(start=0, end=4), pb.PositionRange(start=n - 6, end=n)],
    )
    assert scored.done.finish_reason == Done.FINISH_REASON_LENGTH and scored.done.completion_tokens == 0
    expected_positions = [0, 1, 2, 3, *range(n - 6, n)]
    assert [t.position for t in scored.tokens] == expected_positions
    assert all(t.is_prefill for t in scored.tokens)
    assert [t.id for t in scored.tokens] == [tokens[p] for p in expected_positions]
    logprobs = reference_forward(hf_model, tokens).logits[0].float().log_softmax(-1)
    first = scored.tokens[0]
    assert not first.has_sampled_logprob  # nothing precedes position 0
    for token in scored.tokens[1:]:
        row = logprobs[token.position - 1]
        assert token.has_sampled_logprob
        assert token.sampled_logprob == pytest.approx(row[token.id].item(), abs=2e-3)
        top = row.topk(3)
        assert [a.id for a in token.logprobs] == top.indices.tolist()
        assert [a.logprob for a in token.logprobs] == pytest.approx(top.values.tolist(), abs=2e-3)
    assert await dump(stub, session) == tokens  # scoring appends nothing


async def test_decode_logprobs(stack, stub, model_name, hf_model, hf_greedy) -> None:
    session = await open_session(stub, model_name)
    prompt = encode(stack, "Count: 1, 2, 3,")
    n = len(prompt)
    result = await generate(stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=3, logprob_top_k=2,
                            logprobs_ranges=[pb.PositionRange(start=n - 1, end=n + 2)], **greedy())
    assert [(t.position, t.is_prefill) for t in result.tokens] == [(n - 1, True), (n, False), (n + 1, False), (n + 2, False)]
    decoded = hf_greedy(prompt, 3)
    assert result.decoded == decoded
    logprobs = reference_forward(hf_model, prompt + decoded).logits[0].float().log_softmax(-1)
    for token in result.tokens:
        covered = token.position < n + 2
        assert token.has_sampled_logprob == covered
        if covered:
            assert token.sampled_logprob == pytest.approx(logprobs[token.position - 1, token.id].item(), abs=2e-3)
            assert len(token.logprobs) == 2 and token.logprobs[0].id == logprobs[token.position - 1].argmax().item()


async def test_readouts_equal_transformers_logit_lens(stack, stub, model_name, hf_model) -> None:
    manifest = await stub.GetReadoutManifest(pb.GetReadoutManifestRequest())
    config = hf_model.config
    assert manifest.concepts == stack.settings.sessions.readout_concepts
    assert manifest.hidden_size == config.hidden_size and manifest.dtype == "float32"
    layers = list(manifest.layers)
    assert layers and all(0 <= layer < config.num_hidden_layers for layer in layers)
    assert layers[-1] == config.num_hidden_layers - 1

    session = await open_session(stub, model_name)
    tokens = encode(stack, "I am so happy today, but yesterday was sad.")
    n = len(tokens)
    result = await generate(stub, session_id=session, append_tokens=tokens, offset=0, max_tokens=2,
                            readout_ranges=[pb.PositionRange(start=2, end=n)], **greedy())
    prefill = result.prefill
    assert [t.position for t in prefill] == list(range(2, n))
    assert all(not t.has_sampled_logprob for t in prefill)  # readouts were asked, not logprobs
    assert all(not t.readout for t in result.tokens if not t.is_prefill)

    out = reference_forward(hf_model, tokens)
    unembed = hf_model.get_output_embeddings().weight
    rows = unembed[[stack.tokenizer.encode(w, add_special_tokens=False)[0] for w in manifest.concepts]]
    with torch.inference_mode():
        check_readouts(prefill, out, rows, layers, hf_model)


async def test_readouts_on_decoded_tokens_equal_those_of_the_same_tokens_fed_as_a_prompt(stack, stub, model_name,
                                                                                        hf_greedy) -> None:
    """Readouts reach into the decoded positions as logprobs do: each decoded token arrives with its
    readout (the last one's read by one more step), equal to the readouts of the same tokens appended
    as a prompt; the tokens keep their order and all of them are committed to the session."""
    tokens = encode(stack, "The weather today is")
    n, decode = len(tokens), 4
    session = await open_session(stub, model_name)
    watched = [pb.PositionRange(start=n - 1, end=n + decode)]  # the last prompt position and every decoded one
    result = await generate(stub, session_id=session, append_tokens=tokens, offset=0, max_tokens=decode,
                            readout_ranges=watched, logprobs_ranges=watched, **greedy())
    decoded = [t for t in result.tokens if not t.is_prefill]
    assert result.decoded == hf_greedy(tokens, decode)
    assert [t.position for t in decoded] == list(range(n, n + decode))
    assert all(t.readout and t.has_sampled_logprob for t in decoded)
    assert await dump(stub, session) == tokens + result.decoded

    fed = await open_session(stub, model_name)
    scored = await generate(stub, session_id=fed, append_tokens=tokens + result.decoded, offset=0, max_tokens=0,
                            readout_ranges=[pb.PositionRange(start=n, end=n + decode)])
    assert [t.position for t in scored.prefill] == list(range(n, n + decode))
    for got, want in zip(decoded, scored.prefill, strict=True):
        np.testing.assert_allclose(np.array(got.readout), np.array(want.readout), atol=2e-4, rtol=1e-4)
    # only the watched positions carry readouts: a range short of the last token leaves it without
    partial = await generate(stub, session_id=await open_session(stub, model_name), append_tokens=tokens, offset=0,
                             max_tokens=decode, readout_ranges=[pb.PositionRange(start=n, end=n + 2)], **greedy())
    assert [bool(t.readout) for t in partial.tokens] == [True, True, False, False]
    assert partial.decoded == result.decoded


def check_readouts(prefill, out, rows, layers, hf_model) -> None:
    config = hf_model.config
    for token in prefill:
        got = np.array(token.readout, dtype=np.float32).reshape(len(layers), rows.shape[0])
        for i, layer in enumerate(layers):
            hidden = out.hidden_states[layer + 1][0, token.position]
            # transformers' last hidden state has the final norm applied already
            normed = hidden if layer == config.num_hidden_layers - 1 else hf_model.model.norm(hidden)
            expected = (normed @ rows.T).float().numpy()
            np.testing.assert_allclose(got[i], expected, atol=2e-3, rtol=1e-3)


# -- one turn at a time, cancellation, close -----------------------------------------------------


async def first_decoded(call, count: int) -> list[int]:
    """Read a Generate stream until ``count`` decoded tokens arrived."""
    decoded = []
    async for event in call:
        assert event.HasField("token"), "the turn ended before it could be interrupted"
        if not event.token.is_prefill:
            decoded.append(event.token.id)
            if len(decoded) == count:
                return decoded
    raise AssertionError("the stream ended early")


async def test_busy_session_and_cancel_keeps_exactly_the_tokens_sent(stack, stub, model_name, hf_greedy) -> None:
    session = await open_session(stub, model_name)
    prompt = encode(stack, "Count from one to one hundred: one, two, three, four,")
    call = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=prompt, offset=0, max_tokens=400,
                                            top_k=1), timeout=RPC_TIMEOUT_S)
    seen = await first_decoded(call, 3)
    code, details = await status_of(generate(stub, session_id=session, offset=len(prompt) + 3, max_tokens=1))
    assert code == grpc.StatusCode.ABORTED and "session busy" in details
    # the session is busy, not broken: other calls on it still work
    assert (await dump(stub, session))[: len(prompt)] == prompt
    seen += await first_decoded(call, 2)
    call.cancel()

    async def settled() -> bool:
        length = len(await dump(stub, session))
        try:  # a no-op turn: refused as busy until the cancelled turn lets go of the session
            await generate(stub, session_id=session, offset=length, max_tokens=0)
            return True
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "does not match the session's" in exc.details():
                return False  # the turn let go (and kept its tokens) between the dump and this call: dump again
            assert exc.code() == grpc.StatusCode.ABORTED, exc.details()
            return False

    await wait_for(settled, 30, "the cancelled turn to release its session")
    # the session holds the tokens the server sent: those read here, and maybe a few more that were
    # on their way when the client cancelled; never one that was not sent (they are greedy's)
    tokens = await dump(stub, session)
    decoded = tokens[len(prompt):]
    assert tokens[: len(prompt)] == prompt and decoded[: len(seen)] == seen
    assert len(decoded) < 400, "the cancellation did not stop the turn"
    assert decoded == hf_greedy(prompt, len(decoded))
    seen = decoded
    # the next turn continues from exactly those tokens (the scheduler's KV held more: it backtracks)
    more = encode(stack, " The end.")
    after = await generate(stub, session_id=session, append_tokens=more, offset=len(prompt) + len(seen), max_tokens=4,
                           **greedy())
    assert after.decoded == hf_greedy(prompt + seen + more, 4)


async def test_close_is_idempotent_and_lets_the_kv_go(stack, stub, model_name) -> None:
    session = await open_session(stub, model_name)
    await generate(stub, session_id=session, append_tokens=[1, 2, 3], offset=0, max_tokens=0)
    parked = (await asyncio.to_thread(stack.scheduler_health))["parked_sessions"]
    for _ in range(2):
        await stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    assert (await asyncio.to_thread(stack.scheduler_health))["parked_sessions"] == parked - 1
    await stub.CloseSession(pb.CloseSessionRequest(session_id="sess-never-opened"))
    code, _ = await status_of(stub.DumpSession(pb.DumpSessionRequest(session_id=session)))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = await status_of(generate(stub, session_id=session, offset=3, max_tokens=1))
    assert code == grpc.StatusCode.NOT_FOUND


async def test_close_during_a_turn_cancels_it_and_keeps_no_kv(stack, stub, model_name) -> None:
    """CloseSession while a Generate runs: the turn ends at once as CANCELLED (its tokens would go
    nowhere) and the scheduler keeps no KV for the closed session."""
    before = (await asyncio.to_thread(stack.scheduler_health))["parked_tokens"]
    session = await open_session(stub, model_name)
    prompt = encode(stack, "Count from one to one hundred: one, two, three, four,")
    call = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=prompt, offset=0, max_tokens=400,
                                            top_k=1), timeout=RPC_TIMEOUT_S)
    seen = await first_decoded(call, 2)
    await stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    done = None
    async for event in call:
        if event.HasField("done"):
            done = event.done
    assert done is not None and done.finish_reason == Done.FINISH_REASON_CANCELLED
    assert len(seen) <= done.completion_tokens < 400

    async def released() -> bool:
        health = await asyncio.to_thread(stack.scheduler_health)
        return health["running"] == 0 and health["parked_tokens"] == before

    await wait_for(released, 30, "the closed session's turn to end without parking its KV")


# -- bad input ------------------------------------------------------------------------------------


async def raw_generate(channel: grpc.aio.Channel, data: bytes) -> None:
    """A Generate call with ``data`` as its serialized request."""
    async for _ in channel.unary_stream("/salience.v1.Salience/Generate")(data, timeout=RPC_TIMEOUT_S):
        pass


async def test_bad_input_gets_specific_status_and_other_sessions_go_on(stack, channel, stub, model_name, hf_greedy) -> None:
    bystander = await open_session(stub, model_name)
    prompt = encode(stack, "Bystanders keep working:")
    running = asyncio.ensure_future(
        generate(stub, session_id=bystander, append_tokens=prompt, offset=0, max_tokens=8, **greedy())
    )
    session = await open_session(stub, model_name)
    await generate(stub, session_id=session, append_tokens=[10, 11, 12], offset=0, max_tokens=0)
    max_len = (await stub.OpenSession(pb.OpenSessionRequest(model=model_name))).max_model_len
    vocab = len(stack.tokenizer)
    R = pb.PositionRange
    cases = [
        (stub.OpenSession(pb.OpenSessionRequest(model="gpt-17")), grpc.StatusCode.INVALID_ARGUMENT, "not served"),
        (generate(stub, session_id="sess-nope", append_tokens=[1], offset=0, max_tokens=1), grpc.StatusCode.NOT_FOUND,
         "no session"),
        (stub.ForkSession(pb.ForkSessionRequest(session_id="sess-nope", at_position=0)), grpc.StatusCode.NOT_FOUND, ""),
        (stub.DumpSession(pb.DumpSessionRequest(session_id="sess-nope")), grpc.StatusCode.NOT_FOUND, ""),
        (generate(stub, session_id="", append_tokens=[1], offset=0, max_tokens=1), grpc.StatusCode.NOT_FOUND,
         "empty session_id"),
        (stub.DumpSession(pb.DumpSessionRequest(session_id="")), grpc.StatusCode.NOT_FOUND, ""),
        (stub.ForkSession(pb.ForkSessionRequest(session_id=session, at_position=4)),
         grpc.StatusCode.FAILED_PRECONDITION, "past the session"),
        (generate(stub, session_id=session, offset=3, max_tokens=0, logprobs_ranges=[R(start=2, end=2)]),
         grpc.StatusCode.INVALID_ARGUMENT, "logprobs_ranges"),
        (generate(stub, session_id=session, offset=3, max_tokens=2, logprobs_ranges=[R(start=0, end=6)]),
         grpc.StatusCode.INVALID_ARGUMENT, "logprobs_ranges"),
        (generate(stub, session_id=session, offset=3, max_tokens=2, readout_ranges=[R(start=1, end=6)]),
         grpc.StatusCode.INVALID_ARGUMENT, "readout_ranges"),  # past the decode budget, as logprobs_ranges
        # judged by a drifted offset, the call's problem is the drift, not its ranges or an empty session
        (generate(stub, session_id=session, offset=0, max_tokens=2), grpc.StatusCode.FAILED_PRECONDITION, "offset 0"),
        (generate(stub, session_id=session, offset=1, max_tokens=0, logprobs_ranges=[R(start=0, end=3)]),
         grpc.StatusCode.FAILED_PRECONDITION, "offset 1"),
        # a max_tokens no session could hold is the proto's context overflow, however large
        (generate(stub, session_id=session, offset=3, max_tokens=10**6), grpc.StatusCode.RESOURCE_EXHAUSTED, "context"),
        (generate(stub, session_id=session, append_tokens=[vocab + 5], offset=3, max_tokens=1),
         grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
        (generate(stub, session_id=session, offset=3, max_tokens=1, temperature=-1), grpc.StatusCode.INVALID_ARGUMENT,
         "temperature"),
        (generate(stub, session_id=session, offset=3, max_tokens=1, temperature=float("inf")),
         grpc.StatusCode.INVALID_ARGUMENT, "finite"),
        (generate(stub, session_id=session, offset=3, max_tokens=1, stop_token_ids=list(range(301))),
         grpc.StatusCode.INVALID_ARGUMENT, "at most 300 stop_token_ids"),
        (generate(stub, session_id=session, offset=3, max_tokens=1, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (generate(stub, session_id=session, append_tokens=[13] * max_len, offset=3, max_tokens=0),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "context"),
        (generate(stub, session_id=session, append_tokens=[13] * 10, offset=3, max_tokens=max_len - 12),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "context"),
        (generate(stub, session_id=session, offset=3, max_tokens=1,
                  images=[pb.ImageAttachment(bytes=b"\x89PNG", mime="image/png", pad_range_start=0, pad_range_end=3)]),
         grpc.StatusCode.INVALID_ARGUMENT, "text-only"),
        # bytes that are not the request message (a client built from another .proto, say)
        (channel.unary_unary("/salience.v1.Salience/DumpSession")(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT,
         "the request is not a valid salience.v1.DumpSessionRequest message: Error parsing message"),
        (raw_generate(channel, b"\x0a\x05sess-\x18\x80"), grpc.StatusCode.INVALID_ARGUMENT,
         "the request is not a valid salience.v1.GenerateRequest message"),
    ]
    for call, expected, words in cases:
        code, details = await status_of(call)
        assert code == expected, (expected, details)
        assert words in details, details
    assert await dump(stub, session) == [10, 11, 12]  # no refused call changed the session
    assert (await running).decoded == hf_greedy(prompt, 8)


# -- durability ------------------------------------------------------------------------------------


async def test_sessions_survive_session_store_and_worker_restarts(stack, stub, model_name, hf_greedy) -> None:
    session = await open_session(stub, model_name)
    prompt = encode(stack, "Durable sessions remember:")
    first = await generate(stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=4, **greedy())
    history = prompt + first.decoded

    stack.restart("session_store")
    assert await dump_once_the_store_is_back(stub, session) == history

    assert (await asyncio.to_thread(stack.scheduler_health))["parked_sessions"] > 0
    stack.restart("worker")  # the session's parked KV goes with it: the next turn recomputes it

    async def new_worker_ready() -> bool:
        health = await asyncio.to_thread(stack.scheduler_health)
        return health["ready"] and health["parked_sessions"] == 0  # the old worker is gone, and its KV

    await wait_for(new_worker_ready, 180, "a new worker")
    more = encode(stack, " and so")
    second = await generate(stub, session_id=session, append_tokens=more, offset=len(history), max_tokens=4, **greedy())
    assert second.decoded == hf_greedy(history + more, 4)
    assert await dump(stub, session) == history + more + second.decoded


async def test_a_turn_lost_with_its_worker_says_where_the_session_now_stands(stack, stub, model_name,
                                                                           hf_greedy) -> None:
    """kill -9 of the worker mid-turn: the call ends UNAVAILABLE (retry) and names the session's new length, since
    the session kept the appended tokens and the decoded ones sent (a verbatim retry would be FAILED_PRECONDITION);
    the next turn from there, once a worker is back, equals transformers on the session's tokens."""
    session = await open_session(stub, model_name)
    prompt = encode(stack, "Count from one to one hundred: one, two, three, four,")
    call = stub.Generate(pb.GenerateRequest(session_id=session, append_tokens=prompt, offset=0, max_tokens=400,
                                            top_k=1), timeout=RPC_TIMEOUT_S)
    seen = await first_decoded(call, 2)
    await asyncio.to_thread(stack.kill, "worker")

    async def rest() -> None:
        async for _ in call:
            pass

    code, details = await status_of(rest())
    assert code == grpc.StatusCode.UNAVAILABLE and "retry" in details, details
    tokens = await dump(stub, session)
    assert f"it now holds {len(tokens)} tokens (offset {len(tokens)})" in details, (details, len(tokens))
    decoded = tokens[len(prompt):]
    assert tokens[: len(prompt)] == prompt and decoded[: len(seen)] == seen
    assert decoded == hf_greedy(prompt, len(decoded))

    more = encode(stack, " The end.")
    after = None

    async def next_turn() -> bool:
        nonlocal after
        current = await dump(stub, session)  # a try that failed after it began kept `more`: go on from there
        assert current in (tokens, tokens + more), current
        try:
            after = await generate(stub, session_id=session, append_tokens=more[len(current) - len(tokens):],
                                   offset=len(current), max_tokens=4, **greedy())
            return True
        except grpc.aio.AioRpcError as exc:  # while the worker reloads
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            return False

    await wait_for(next_turn, 180, "a new worker")
    assert after.decoded == hf_greedy(tokens + more, 4)
    assert await dump(stub, session) == tokens + more + after.decoded


async def test_a_turn_refused_while_the_session_store_is_down_leaves_no_trace(stack, stub, model_name,
                                                                            hf_greedy) -> None:
    """A Generate that gave up on the stopped session store (UNAVAILABLE, "retry shortly") is never delivered to
    it once it is back: the session holds what it held and is not busy, so the same call retried just works."""
    session = await open_session(stub, model_name)
    prompt = encode(stack, "The lighthouse keeper wrote in his log")
    first = await generate(stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=3, **greedy())
    history = prompt + first.decoded
    more = stack.tokenizer.encode(" Then", add_special_tokens=False)
    call = dict(session_id=session, append_tokens=more, offset=len(history), max_tokens=3, **greedy())
    await asyncio.to_thread(stack.stop, "session_store")
    try:
        code, details = await status_of(generate(stub, **call))
        assert code == grpc.StatusCode.UNAVAILABLE and "retry" in details, details
    finally:
        await asyncio.to_thread(stack.start, "session_store")

    assert await dump_once_the_store_is_back(stub, session) == history  # the refused call committed nothing
    retried = await generate(stub, **call)  # and holds no lease: not ABORTED
    assert retried.decoded == hf_greedy(history + more, 3)
    assert await dump(stub, session) == history + more + retried.decoded


async def test_scoring_across_prefill_chunks(stack, stub, model_name, hf_model) -> None:
    chunk = stack.settings.limits.prefill_chunk_tokens
    text = " ".join(f"Line {i}: the tide came in and went out again." for i in range(chunk // 8))
    tokens = encode(stack, text)[: chunk + 40]
    assert len(tokens) == chunk + 40
    session = await open_session(stub, model_name)
    around = pb.PositionRange(start=chunk - 3, end=chunk + 3)  # the first chunk's last positions, the second's first
    scored = await generate(stub, session_id=session, append_tokens=tokens, offset=0, max_tokens=0,
                            logprobs_ranges=[around], readout_ranges=[around])
    assert [t.position for t in scored.tokens] == list(range(chunk - 3, chunk + 3))
    logprobs = reference_forward(hf_model, tokens).logits[0].float().log_softmax(-1)
    for token in scored.tokens:
        assert token.has_sampled_logprob and token.readout
        assert token.sampled_logprob == pytest.approx(logprobs[token.position - 1, token.id].item(), abs=2e-3)


async def test_close_session_answers_while_the_scheduler_is_down(stack, stub, model_name) -> None:
    """CloseSession answers once the session store closed the session; the word to the scheduler that its parked KV
    may go does not hold it up (with the scheduler stopped it answered after the store's 10 s timeout, so a client
    with a shorter deadline saw DEADLINE_EXCEEDED for a session that was closed)."""
    session = await open_session(stub, model_name)
    await asyncio.to_thread(stack.stop, "scheduler")
    try:
        await stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=3)
        code, _ = await status_of(dump(stub, session))
        assert code == grpc.StatusCode.NOT_FOUND
    finally:
        await asyncio.to_thread(stack.start, "scheduler")

    async def serving() -> bool:
        reply = await probe_health(stack.settings.endpoint("scheduler"), timeout=2.0)
        return reply is not None and reply.ready

    await wait_for(serving, 60, "the scheduler to serve again")
