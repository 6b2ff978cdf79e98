"""The vision-language runner: the tiny random Qwen2-VL served through the engine against
transformers' own Qwen2VLForConditionalGeneration on the same weights and inputs."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from common.config import Settings
from common.model_source import load_tokenizer
from common.vision import VisionSpec
from common.wire import ImageInput, SamplingParams, ScoreQuery, SeqStep
from services.worker.engine import Engine
from services.worker.model_loader import LoadedModel, load_model
from services.worker.readouts import Readouts
from tests.images import png
from tests.worker.conftest import GREEDY, Driver


@pytest.fixture(scope="module")
def vl() -> LoadedModel:
    return load_model(Settings(model="random:qwen2-vl-tiny", device="cpu"), lambda progress, message: None)


@pytest.fixture(scope="module")
def spec(vl: LoadedModel) -> VisionSpec:
    assert vl.vision is not None
    return vl.vision


@pytest.fixture(scope="module")
def vl_engine(vl: LoadedModel) -> Engine:
    return Engine(vl, num_blocks=128)


def block(spec: VisionSpec, data: bytes) -> list[int]:
    n = spec.feature_count(spec.process(spec.decode(data)).grid_thw)
    return [spec.vision_start_id] + [spec.image_pad_id] * n + [spec.vision_end_id]


def build(spec: VisionSpec, *parts: list[int] | bytes) -> tuple[list[int], list[ImageInput]]:
    """A prompt of text token lists and images (bytes), with each image's block placed in it."""
    tokens: list[int] = []
    images: list[ImageInput] = []
    for part in parts:
        if isinstance(part, bytes):
            run = block(spec, part)
            images.append(ImageInput(start=len(tokens), end=len(tokens) + len(run), data=part, mime="image/png"))
            tokens += run
        else:
            tokens += part
    return tokens, images


def reference(vl: LoadedModel, spec: VisionSpec, prompt: list[int], images: list[ImageInput], n: int) -> list[int]:
    """transformers' greedy generate with the processor's pixel values, as its docs feed it."""
    processed = [spec.process(spec.decode(image.data)) for image in images]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = vl.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=torch.cat([p.pixel_values for p in processed]),
            image_grid_thw=torch.tensor([p.grid_thw for p in processed]),
            mm_token_type_ids=(ids == spec.image_pad_id).int(),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def decode(driver: Driver, seq_id: int, first: int, n: int) -> list[int]:
    tokens = [first]
    while len(tokens) < n:
        result = driver.step([SeqStep(seq_id=seq_id, tokens=[tokens[-1]])])
        assert not result.failures, result.failures
        tokens.append(result.samples[seq_id].token_id)
    return tokens


def serve(engine: Engine, seq_id: int, chunks: list[tuple[list[int], list[ImageInput]]], n: int) -> list[int]:
    """Feed the prompt in the given chunks (the last one samples), decode to n tokens, free."""
    driver = Driver(engine)
    result = None
    for i, (tokens, images) in enumerate(chunks):
        last = i == len(chunks) - 1
        result = driver.step(
            [SeqStep(seq_id=seq_id, tokens=tokens, sample=last, sampling=GREEDY if i == 0 else None, images=images)]
        )
        assert not result.failures, result.failures
    assert result is not None
    out = decode(driver, seq_id, result.samples[seq_id].token_id, n)
    engine.free([seq_id])
    return out


def test_vl_model_runs_on_the_fallback_with_the_real_processor(
    vl: LoadedModel, spec: VisionSpec, vl_engine: Engine
) -> None:
    assert type(vl.model).__name__ == "Qwen2VLForConditionalGeneration"
    assert vl_engine.backend == "transformers"
    # 224x224 -> 16x16 patches of 14 pixels -> 64 features after the 2x2 merge
    processed = spec.process(spec.decode(png(0)))
    assert processed.grid_thw == (1, 16, 16)
    assert spec.feature_count(processed.grid_thw) == 64
    assert spec.feature_count(spec.process(spec.decode(png(0, (280, 140)))).grid_thw) == 50  # 10x20 grid


def test_image_prompt_greedy_matches_transformers(vl: LoadedModel, spec: VisionSpec, vl_engine: Engine) -> None:
    prompt, images = build(spec, [11, 22, 33, 44], png(1), [55, 66, 77])
    want = reference(vl, spec, prompt, images, 16)
    assert serve(vl_engine, 1, [(prompt, images)], 16) == want


def test_text_prompt_on_the_vl_model_matches_transformers(vl: LoadedModel, spec: VisionSpec, vl_engine: Engine) -> None:
    prompt = [11, 22, 33, 44, 55, 66, 77, 88]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = vl.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                 min_new_tokens=12, pad_token_id=0)[0, len(prompt) :].tolist()
    assert serve(vl_engine, 3, [(prompt[:3], []), (prompt[3:], [])], 12) == want


def test_chunked_prefill_and_two_images_match_transformers(
    vl: LoadedModel, spec: VisionSpec, vl_engine: Engine
) -> None:
    prompt, images = build(spec, [11, 22], png(2, (280, 140)), [33, 44, 55], png(3), [66])
    want = reference(vl, spec, prompt, images, 12)
    first_end = images[0].end + 2  # chunk 1: text, image 1, some text; chunk 2: the rest with image 2
    chunks = [(prompt[:first_end], images[:1]), (prompt[first_end:], images)]  # images before a chunk are skipped
    assert serve(vl_engine, 2, chunks, 12) == want


def test_different_images_give_different_outputs(spec: VisionSpec, vl_engine: Engine) -> None:
    outputs = []
    for seed in (4, 5):
        prompt, images = build(spec, [11, 22], png(seed), [33])
        outputs.append(serve(vl_engine, 10 + seed, [(prompt, images)], 8))
    assert outputs[0] != outputs[1]
    # and the image is really used: the same block without its image (pads as plain tokens) differs too
    prompt, images = build(spec, [11, 22], png(4), [33])
    with_no_image = serve(vl_engine, 20, [(prompt, [])], 8)
    assert with_no_image != outputs[0]


def test_fork_and_backtrack_keep_image_positions(vl: LoadedModel, spec: VisionSpec, vl_engine: Engine) -> None:
    prompt, images = build(spec, [11, 22], png(6), [33, 44])
    want = reference(vl, spec, prompt, images, 10)
    driver = Driver(vl_engine)
    result = driver.step([SeqStep(seq_id=30, tokens=prompt, sampling=GREEDY, images=images)])
    assert not result.failures, result.failures
    first = result.samples[30].token_id
    # a fork decodes the same continuation as its parent would
    result = driver.step([SeqStep(seq_id=31, tokens=[], fork_of=30, sample=True)])
    assert not result.failures, result.failures
    assert decode(driver, 31, result.samples[31].token_id, 10) == want
    # the parent backtracks over its text after the image and refeeds it: same positions, same output
    result = driver.step([SeqStep(seq_id=30, tokens=[33, 44], backtrack=2)])
    assert not result.failures, result.failures
    assert result.samples[30].token_id == first
    assert decode(driver, 30, first, 10) == want
    vl_engine.free([30, 31])


def test_refeeding_the_end_of_a_block(vl: LoadedModel, spec: VisionSpec, vl_engine: Engine) -> None:
    """A turn that recomputes a session's last token, <|vision_end|>, sends the image again with the
    chunk: its pads are in the KV already, so only a chunk cutting through them is refused."""
    prompt, images = build(spec, [11, 22], png(9))
    want = reference(vl, spec, prompt + [33], images, 6)
    driver = Driver(vl_engine)
    result = driver.step([SeqStep(seq_id=60, tokens=prompt, sample=False, sampling=GREEDY, images=images)])
    assert not result.failures, result.failures
    result = driver.step([SeqStep(seq_id=60, tokens=[spec.vision_end_id, 33], backtrack=1, images=images)])
    assert not result.failures, result.failures
    assert decode(driver, 60, result.samples[60].token_id, 6) == want
    result = driver.step([SeqStep(seq_id=60, tokens=prompt[-10:] + [33], backtrack=11, images=images)])
    assert "is split: its pad tokens before" in {f.seq_id: f.message for f in result.failures}[60]


def test_prompt_scores_and_readouts_match_transformers(vl: LoadedModel, spec: VisionSpec) -> None:
    """Per-position logprobs and logit-lens readouts on the fallback runner, after an image, against
    transformers' own forward over the same prompt and pixels."""
    settings = Settings(model="random:qwen2-vl-tiny", device="cpu")
    readouts = Readouts.build(settings.sessions, num_layers=vl.config.get_text_config().num_hidden_layers,
                              unembedding=vl.model.get_output_embeddings().weight.detach(),
                              tokenizer=load_tokenizer(settings), dtype=vl.dtype)
    engine = Engine(vl, num_blocks=64, readouts=readouts)
    prompt, images = build(spec, [11, 22], png(11), [33, 44, 55])
    positions = [len(prompt) - 4, len(prompt) - 2, len(prompt) - 1]  # <|vision_end|> and text after the image
    scores = [ScoreQuery(p, prompt[p + 1] if p + 1 < len(prompt) else 7) for p in positions]
    result = Driver(engine).step([SeqStep(seq_id=70, tokens=prompt, sample=False, sampling=GREEDY, images=images,
                                          scores=scores, top_logprobs=3, readouts=positions)])
    assert not result.failures, result.failures

    processed = spec.process(spec.decode(images[0].data))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = vl.model(input_ids=ids, pixel_values=processed.pixel_values,
                          image_grid_thw=torch.tensor([processed.grid_thw]),
                          mm_token_type_ids=(ids == spec.image_pad_id).int()).logits[0].float()
    logprobs = logits.log_softmax(-1)
    for got, query in zip(result.scores[70], scores):
        assert (got.position, got.target) == (query.position, query.target)
        assert got.logprob == pytest.approx(float(logprobs[query.position, query.target]), abs=1e-4)
        assert [t.token_id for t in got.top] == logprobs[query.position].topk(3).indices.tolist()
    # the last readout layer is the final layer: its logit lens is the model's logits at the concepts' tokens
    assert readouts.layers[-1] == vl.config.get_text_config().num_hidden_layers - 1
    rows = [load_tokenizer(settings).encode(w, add_special_tokens=False)[0] for w in readouts.concepts]
    for got in result.readouts[70]:
        values = np.frombuffer(got.values, dtype="<f4").reshape(len(readouts.layers), len(readouts.concepts))
        assert values[-1] == pytest.approx(logits[got.position, rows].numpy(), abs=1e-3)
    engine.free([70])


def test_bad_image_fails_its_sequence_only(spec: VisionSpec, vl_engine: Engine) -> None:
    prompt, images = build(spec, [11], png(7), [22])
    short_run = [11, spec.vision_start_id] + [spec.image_pad_id] * 63 + [spec.vision_end_id, 22]  # one pad too few
    short = ImageInput(start=1, end=66, data=images[0].data)
    garbage = ImageInput(start=images[0].start, end=images[0].end, data=b"not an image")
    driver = Driver(vl_engine)
    result = driver.step(
        [
            SeqStep(seq_id=40, tokens=short_run, sampling=GREEDY, images=[short]),
            SeqStep(seq_id=41, tokens=prompt, sampling=GREEDY, images=[garbage]),
            SeqStep(seq_id=42, tokens=prompt, sampling=GREEDY, images=images),
        ]
    )
    failures = {f.seq_id: f.message for f in result.failures}
    assert "63 pad tokens; the image has 64 features" in failures[40]
    assert "not a readable image" in failures[41]
    assert 42 not in failures and 42 in result.samples
    vl_engine.free([42])


def test_text_only_engine_refuses_images(engine: Engine, spec: VisionSpec) -> None:
    prompt, images = build(spec, [11], png(8), [22])
    result = Driver(engine).step([SeqStep(seq_id=50, tokens=[1, 2, 3], sampling=SamplingParams(temperature=0),
                                          images=images)])
    assert [f.seq_id for f in result.failures] == [50]
    assert "text-only" in result.failures[0].message
