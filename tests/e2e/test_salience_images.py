"""Images over Salience end to end: a real stack serving the tiny random Qwen2-VL, a
grpcio client generated from salience.proto, and transformers' own Qwen2VLForConditionalGeneration
on the same random weights as the oracle. Also: the default text-only model refuses any image.

Greedy decoding is asked for the proto's way (top_k=1; temperature 0 means the default 1.0).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import torch

from common.config import Settings
from common.model_source import load_tokenizer
from common.protos.salience.v1 import salience_pb2 as pb
from common.protos.salience.v1 import salience_pb2_grpc as pb_grpc
from common.vision import VisionSpec
from services.worker.model_loader import LoadedModel, load_model
from tests.images import png
from tests.stack import Stack, start_stack

RPC_TIMEOUT_S = 120.0
MODEL = "random:qwen2-vl-tiny"
SERVED = "tiny-qwen2-vl"
TEXT_1 = [1, 504, 2119, 28, 216]  # a few plain token ids around the image
TEXT_2 = [3101, 30, 216]


@pytest.fixture(scope="module")
def vl_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    started = start_stack(
        tmp_path_factory.mktemp("vl-stack"),
        TILLER_MODEL=MODEL,
        TILLER_SERVED_MODEL_NAME=SERVED,
        TILLER_DEVICE="cpu",
        TILLER_DTYPE="float32",
        TILLER_LIMITS__MAX_BATCH_SIZE="4",
        TILLER_LIMITS__MAX_MODEL_LEN="512",
        TILLER_LIMITS__PREFILL_CHUNK_TOKENS="48",  # smaller than an image block: chunks must not split it
    )
    yield started
    started.down()


@pytest.fixture(scope="module")
def oracle() -> LoadedModel:
    """The same random weights the worker initialised (same config, same seed), in this process."""
    return load_model(Settings(model=MODEL, device="cpu", dtype="float32"), lambda progress, message: None)


@pytest.fixture(scope="module")
def spec(oracle: LoadedModel) -> VisionSpec:
    assert oracle.vision is not None
    return oracle.vision


@pytest.fixture(scope="module")
async def stub(vl_stack: Stack) -> AsyncIterator[pb_grpc.SalienceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{vl_stack.settings.grpc_port}") as channel:
        yield pb_grpc.SalienceStub(channel)


def image_block(spec: VisionSpec, data: bytes) -> list[int]:
    n = spec.feature_count(spec.process(spec.decode(data)).grid_thw)
    return [spec.vision_start_id] + [spec.image_pad_id] * n + [spec.vision_end_id]


def reference(oracle: LoadedModel, spec: VisionSpec, tokens: list[int], images: dict[int, bytes], n: int) -> list[int]:
    """transformers' greedy continuation of ``tokens`` (images: block start -> bytes), cut after the
    first end-of-sequence token as the server stops there."""
    processed = [spec.process(spec.decode(images[start])) for start in sorted(images)]
    ids = torch.tensor([tokens])
    kwargs = {}
    if processed:
        kwargs = dict(
            pixel_values=torch.cat([p.pixel_values for p in processed]),
            image_grid_thw=torch.tensor([p.grid_thw for p in processed]),
            mm_token_type_ids=(ids == spec.image_pad_id).int(),
        )
    with torch.inference_mode():
        out = oracle.model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
            pad_token_id=0, **kwargs,
        )[0, len(tokens) :].tolist()
    for i, token in enumerate(out):
        if token in oracle.eos_token_ids:
            return out[: i + 1]
    return out


async def stream(stub: pb_grpc.SalienceStub, **fields) -> tuple[list[pb.Token], pb.GenerateDone]:
    """Every Token event of a greedy Generate call, and its Done."""
    call = stub.Generate(pb.GenerateRequest(top_k=1, **fields), timeout=RPC_TIMEOUT_S)
    tokens, done = [], None
    async for event in call:
        if event.HasField("token"):
            tokens.append(event.token)
        else:
            done = event.done
    assert done is not None
    return tokens, done


async def generate(stub: pb_grpc.SalienceStub, **fields) -> tuple[list[int], pb.GenerateDone]:
    """The decoded token ids of a greedy Generate call, and its Done."""
    tokens, done = await stream(stub, **fields)
    return [t.id for t in tokens if not t.is_prefill], done


async def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


async def open_session(stub: pb_grpc.SalienceStub) -> str:
    return (await stub.OpenSession(pb.OpenSessionRequest(model=SERVED), timeout=RPC_TIMEOUT_S)).session_id


async def dump(stub: pb_grpc.SalienceStub, session_id: str) -> list[int]:
    return list((await stub.DumpSession(pb.DumpSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT_S)).tokens)


async def wait_for_new_worker(stack: Stack) -> None:
    """After a worker restart: the scheduler dropped the old worker and the new one is ready."""
    restarted = time.monotonic()
    while True:
        health = await asyncio.to_thread(stack.scheduler_health)
        worker = health["worker"]
        settled = time.monotonic() - restarted > stack.settings.limits.peer_suspect_grace_s + 1  # the old one is dropped by then
        if settled and worker["stage"] == "ready" and worker["workers"] == 1:
            return
        assert time.monotonic() - restarted < 120, f"no worker came back: {health}"
        await asyncio.sleep(0.5)


def attachment(data: bytes, start: int, end: int) -> pb.ImageAttachment:
    return pb.ImageAttachment(bytes=data, mime="image/png", pad_range_start=start, pad_range_end=end)


async def test_image_turns_match_transformers_and_survive_a_worker_restart(
    stub: pb_grpc.SalienceStub, vl_stack: Stack, oracle: LoadedModel, spec: VisionSpec
) -> None:
    image = png(1)
    block = image_block(spec, image)
    assert len(block) == 64 + 2  # 224x224: a 16x16 patch grid, 2x2 merged
    start = len(TEXT_1)
    prompt = TEXT_1 + block + TEXT_2
    session = await open_session(stub)
    decoded, done = await generate(
        stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=8,
        images=[attachment(image, start, start + len(block))],
    )
    assert decoded == reference(oracle, spec, prompt, {start: image}, 8)
    assert done.prompt_tokens == len(prompt)
    tokens = await dump(stub, session)
    assert tokens == prompt + decoded

    # the next turn sends only new text: the session keeps the image
    more = [28, 1550, 30]
    decoded2, _ = await generate(stub, session_id=session, append_tokens=more, offset=len(tokens), max_tokens=6)
    tokens += more
    assert decoded2 == reference(oracle, spec, tokens, {start: image}, 6)
    tokens += decoded2

    # a restarted worker has no KV: the whole session is recomputed, image included
    vl_stack.restart("worker")
    await wait_for_new_worker(vl_stack)
    decoded3, _ = await generate(stub, session_id=session, append_tokens=[216], offset=len(tokens), max_tokens=6)
    tokens += [216]
    assert decoded3 == reference(oracle, spec, tokens, {start: image}, 6)
    tokens += decoded3

    # the session store keeps the image bytes durably, and a worker that lost the KV again recomputes from them
    vl_stack.restart("session_store")
    vl_stack.restart("worker")
    await wait_for_new_worker(vl_stack)
    decoded4, _ = await generate(stub, session_id=session, append_tokens=[28], offset=len(tokens), max_tokens=6)
    tokens += [28]
    assert decoded4 == reference(oracle, spec, tokens, {start: image}, 6)


async def test_different_images_give_different_tokens(stub: pb_grpc.SalienceStub, spec: VisionSpec) -> None:
    outputs = []
    for seed in (2, 3):
        image = png(seed)
        block = image_block(spec, image)
        session = await open_session(stub)
        decoded, _ = await generate(
            stub, session_id=session, append_tokens=TEXT_1 + block, offset=0, max_tokens=8,
            images=[attachment(image, len(TEXT_1), len(TEXT_1) + len(block))],
        )
        outputs.append(decoded)
    assert outputs[0] != outputs[1]


async def test_concurrent_sessions_keep_their_own_images(
    stub: pb_grpc.SalienceStub, oracle: LoadedModel, spec: VisionSpec
) -> None:
    images = [png(10 + i, size) for i, size in enumerate([(224, 224), (280, 140), (140, 280)])]
    prompts = []
    for i, image in enumerate(images):
        block = image_block(spec, image)
        prompts.append((TEXT_1[: i + 2] + block + TEXT_2, len(TEXT_1[: i + 2]), len(block)))
    sessions = [await open_session(stub) for _ in images]
    results = await asyncio.gather(*(
        generate(stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=10,
                 images=[attachment(image, start, start + n)])
        for session, image, (prompt, start, n) in zip(sessions, images, prompts)
    ))
    for (decoded, _), image, (prompt, start, _) in zip(results, images, prompts):
        assert decoded == reference(oracle, spec, prompt, {start: image}, 10)


async def test_a_second_image_in_a_later_turn(
    stub: pb_grpc.SalienceStub, oracle: LoadedModel, spec: VisionSpec
) -> None:
    first, second = png(4), png(5, (280, 140))  # the second: a 10x20 grid, 50 pads
    block1, block2 = image_block(spec, first), image_block(spec, second)
    assert len(block2) == 50 + 2
    session = await open_session(stub)
    turn1 = TEXT_1 + block1
    decoded, _ = await generate(stub, session_id=session, append_tokens=turn1, offset=0, max_tokens=3,
                                images=[attachment(first, len(TEXT_1), len(turn1))])
    tokens = turn1 + decoded
    at = len(tokens)
    turn2 = block2 + TEXT_2
    decoded2, _ = await generate(stub, session_id=session, append_tokens=turn2, offset=at, max_tokens=6,
                                 images=[attachment(second, at, at + len(block2))])
    tokens += turn2
    assert decoded2 == reference(oracle, spec, tokens, {len(TEXT_1): first, at: second}, 6)


async def test_fork_may_not_split_an_image_block(
    stub: pb_grpc.SalienceStub, oracle: LoadedModel, spec: VisionSpec
) -> None:
    image = png(6)
    block = image_block(spec, image)
    start, end = len(TEXT_1), len(TEXT_1) + len(block)
    session = await open_session(stub)
    await generate(stub, session_id=session, append_tokens=TEXT_1 + block + TEXT_2, offset=0, max_tokens=0,
                   images=[attachment(image, start, end)])
    for inside in (start + 1, start + 30, end - 1):
        code, message = await refused(
            stub.ForkSession(pb.ForkSessionRequest(session_id=session, at_position=inside), timeout=RPC_TIMEOUT_S)
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION, message
    # a clean boundary after the block: the fork keeps the image and generates from it
    fork = (await stub.ForkSession(pb.ForkSessionRequest(session_id=session, at_position=end + 1),
                                   timeout=RPC_TIMEOUT_S)).session_id
    assert await dump(stub, fork) == TEXT_1 + block + TEXT_2[:1]
    decoded, _ = await generate(stub, session_id=fork, append_tokens=[216], offset=end + 1, max_tokens=6)
    assert decoded == reference(oracle, spec, TEXT_1 + block + TEXT_2[:1] + [216], {start: image}, 6)
    # a fork before the block has no image; its tokens are plain text
    early = (await stub.ForkSession(pb.ForkSessionRequest(session_id=session, at_position=start),
                                    timeout=RPC_TIMEOUT_S)).session_id
    assert await dump(stub, early) == TEXT_1


async def test_truncating_turns_keep_or_drop_whole_images(
    stub: pb_grpc.SalienceStub, oracle: LoadedModel, spec: VisionSpec
) -> None:
    image = png(8)
    block = image_block(spec, image)
    start, end = len(TEXT_1), len(TEXT_1) + len(block)
    session = await open_session(stub)
    decoded, _ = await generate(stub, session_id=session, append_tokens=TEXT_1 + block + TEXT_2, offset=0,
                                max_tokens=4, images=[attachment(image, start, end)])
    length = end + len(TEXT_2) + len(decoded)
    # rewinding into the block would leave half an image
    code, message = await refused(
        generate(stub, session_id=session, append_tokens=[216], offset=start + 10, truncating=True, max_tokens=1)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION, message
    assert len(await dump(stub, session)) == length
    # rewinding to just after the block keeps the image
    decoded, _ = await generate(stub, session_id=session, append_tokens=[216], offset=end, truncating=True,
                                max_tokens=6)
    assert decoded == reference(oracle, spec, TEXT_1 + block + [216], {start: image}, 6)
    # rewinding to before the block drops it: the same pad tokens appended again are plain text unless
    # attached again, and a new attachment there is a different image
    other = png(9)
    decoded, _ = await generate(stub, session_id=session, append_tokens=block, offset=start, truncating=True,
                                max_tokens=6, images=[attachment(other, start, end)])
    assert decoded == reference(oracle, spec, TEXT_1 + block, {start: other}, 6)


async def test_scoring_and_readouts_after_an_image(stub: pb_grpc.SalienceStub, oracle: LoadedModel, spec: VisionSpec) -> None:
    image = png(12)
    block = image_block(spec, image)
    start, end = len(TEXT_1), len(TEXT_1) + len(block)
    prompt = TEXT_1 + block + TEXT_2
    session = await open_session(stub)
    tokens, done = await stream(
        stub, session_id=session, append_tokens=prompt, offset=0, max_tokens=0, images=[attachment(image, start, end)],
        logprobs_ranges=[pb.PositionRange(start=end - 1, end=len(prompt))], logprob_top_k=2,
        readout_ranges=[pb.PositionRange(start=end - 1, end=end + 1)],
    )
    assert done.completion_tokens == 0
    processed = spec.process(spec.decode(image))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = oracle.model(input_ids=ids, pixel_values=processed.pixel_values,
                              image_grid_thw=torch.tensor([processed.grid_thw]),
                              mm_token_type_ids=(ids == spec.image_pad_id).int()).logits[0].float()
    logprobs = logits.log_softmax(-1)
    scored = [t for t in tokens if t.has_sampled_logprob]
    assert [t.position for t in scored] == list(range(end - 1, len(prompt)))
    for token in scored:
        assert token.id == prompt[token.position]
        assert token.sampled_logprob == pytest.approx(logprobs[token.position - 1, token.id].item(), abs=1e-3)
        assert [a.id for a in token.logprobs] == logprobs[token.position - 1].topk(2).indices.tolist()
    # readouts: the last readout layer is the final one, whose logit lens is the model's own logits
    manifest = await stub.GetReadoutManifest(pb.GetReadoutManifestRequest(), timeout=RPC_TIMEOUT_S)
    assert list(manifest.layers)[-1] == oracle.config.get_text_config().num_hidden_layers - 1
    tokenizer = load_tokenizer(Settings(model=MODEL))
    rows = [tokenizer.encode(word, add_special_tokens=False)[0] for word in manifest.concepts]
    read = {t.position: t.readout for t in tokens if len(t.readout)}
    assert sorted(read) == [end - 1, end]
    for position, values in read.items():
        last = np.array(values).reshape(len(manifest.layers), len(manifest.concepts))[-1]
        assert last == pytest.approx(logits[position, rows].numpy(), abs=1e-3)


async def test_mismatched_ranges_are_invalid_argument(stub: pb_grpc.SalienceStub, spec: VisionSpec) -> None:
    image = png(7)
    block = image_block(spec, image)
    session = await open_session(stub)
    start, end = len(TEXT_1), len(TEXT_1) + len(block)
    cases = {
        "wrong N": (TEXT_1 + block[:-2] + block[-1:], [attachment(image, start, end - 1)], "makes 64 features"),
        "not on the pads": (TEXT_1 + block, [attachment(image, start - 1, end - 1)], "not <|vision_start|>"),
        "out of bounds": (TEXT_1 + block, [attachment(image, start, end + 5)], "must lie within"),
        "overlap": (TEXT_1 + block, [attachment(image, start, end), attachment(image, start, end)], "overlaps"),
        "no attachment": (TEXT_1 + block, [], "needs a matching ImageAttachment"),
        "not an image": (TEXT_1 + block, [attachment(b"GIF89a broken", start, end)], "not a readable image"),
    }
    for name, (tokens, images, expected) in cases.items():
        code, message = await refused(
            generate(stub, session_id=session, append_tokens=tokens, offset=0, max_tokens=1, images=images)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, message)
        assert expected in message, (name, message)
    assert await dump(stub, session) == []  # no refused call changed the session
    # and the session still works
    decoded, _ = await generate(stub, session_id=session, append_tokens=TEXT_1 + block, offset=0, max_tokens=2,
                                images=[attachment(image, start, end)])
    assert len(decoded) >= 1


async def test_text_only_model_refuses_images(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.settings.grpc_port}") as channel:
        text_stub = pb_grpc.SalienceStub(channel)
        opened = await text_stub.OpenSession(pb.OpenSessionRequest(model=stack.settings.served_model_name),
                                             timeout=RPC_TIMEOUT_S)
        code, message = await refused(
            generate(text_stub, session_id=opened.session_id, append_tokens=[1, 2, 3], offset=0, max_tokens=1,
                     images=[attachment(png(0), 0, 3)])
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the served model {stack.settings.served_model_name} is text-only" in message
        # the session is untouched and serves text as before
        assert list((await text_stub.DumpSession(pb.DumpSessionRequest(session_id=opened.session_id),
                                                 timeout=RPC_TIMEOUT_S)).tokens) == []
        decoded, _ = await generate(text_stub, session_id=opened.session_id, append_tokens=[1, 2, 3], offset=0,
                                    max_tokens=2)
        assert len(decoded) >= 1
