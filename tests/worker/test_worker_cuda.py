"""The GPU paths of the worker: decode steps replayed from CUDA graphs, the Triton kernels, masks as
device-side bias.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with
``python -m pytest -q tests/worker/test_worker_cuda.py``. Random weights in float32, so the oracle
(transformers' own greedy generate on the same weights) is exact up to kernel rounding.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.wire import SamplingParams, SeqStep
from services.worker.engine import Engine
from services.worker.model_loader import LoadedModel
from services.worker.models.tiny import tiny_configs
from services.worker.runner import SeqInput
from services.worker.sampler import SeqSampler, sample
from tests.worker.conftest import Driver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0)
CONFIG = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.float32).to("cuda").eval()
    return LoadedModel(model=model, config=model.config, name="tiny", device=torch.device("cuda"),
                       dtype=torch.float32, eos_token_ids=[], max_model_len=256)


def _generate(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _decode_batch(engine: Engine, prompts: list[list[int]], n: int, follow: bool = False) -> list[list[int]]:
    """Prefill every prompt in one step, then decode all of them together for ``n - 1`` steps (with
    ``follow``, each decode step has them follow, feeding the worker's own last samples, as the
    pipelined scheduler does)."""
    driver = Driver(engine)
    ids = list(range(1, len(prompts) + 1))
    result = driver.step([SeqStep(seq_id=i, tokens=p, sampling=GREEDY) for i, p in zip(ids, prompts)])
    out = [[result.samples[i].token_id] for i in ids]
    for _ in range(n - 1):
        if follow:
            result = driver.step([], follows=ids)
        else:
            result = driver.step([SeqStep(seq_id=i, tokens=[o[-1]]) for i, o in zip(ids, out)])
        assert not result.failures, result.failures
        for i, o in zip(ids, out):
            o.append(result.samples[i].token_id)
    engine.free(ids)
    return out


@pytest.mark.parametrize("name", ["mistral-window", "gemma3"])
def test_graph_decode_of_a_windowed_model_equals_eager(name: str) -> None:
    """A replayed decode's windowed layers attend within the window too (the captured plan has its mask)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_configs()[name], dtype=torch.float32).to("cuda").eval()
    windowed = LoadedModel(model=model, config=model.config, name=name, device=torch.device("cuda"),
                           dtype=torch.float32, eos_token_ids=[], max_model_len=128)
    graphed, eager = Engine(windowed, num_blocks=64, cuda_graph_batch=4), Engine(windowed, num_blocks=64)
    assert graphed.backend == "paged+cuda_graphs"
    prompts = [[(7 * i + 3) % 512 for i in range(length)] for length in (3, 21)]  # the window is 8 keys
    assert _decode_batch(graphed, prompts, 12) == _decode_batch(eager, prompts, 12)


def test_graph_decode_equals_eager_and_transformers(loaded: LoadedModel) -> None:
    graphed = Engine(loaded, num_blocks=256, cuda_graph_batch=8)
    eager = Engine(loaded, num_blocks=256)
    assert graphed.backend == "paged+cuda_graphs" and eager.backend == "paged"
    rng = np.random.default_rng(1)
    # 5 sequences (a padded batch bucket of 8); the longest crosses from the 4-block width bucket
    # (up to 64 tokens) into the 8-block one while decoding
    prompts = [rng.integers(1, 2048, size=length).tolist() for length in (3, 15, 16, 40, 50)]
    n = 40
    got = _decode_batch(graphed, prompts, n)
    assert graphed.runner.graphs.captured >= 2  # more than one width bucket was needed
    assert got == _decode_batch(eager, prompts, n)
    assert got == _decode_batch(graphed, prompts, n, follow=True)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _generate(loaded, prompt, n)


def test_triton_kernels_decode_as_torch_ops_do(loaded: LoadedModel) -> None:
    """The Triton kernels (norms, rotation with the KV write, attention read from the blocks in
    place), replayed from CUDA graphs and eager, in float32: transformers' greedy tokens, as torch's
    ops give them (the two differ in float32's last bits only)."""
    graphed = Engine(loaded, num_blocks=256, cuda_graph_batch=8, gpu_kernels="triton")
    eager = Engine(loaded, num_blocks=256, gpu_kernels="triton")
    assert graphed.backend == "paged+cuda_graphs+triton" and eager.backend == "paged+triton"
    assert Engine(loaded, num_blocks=16).backend == "paged"  # the default: torch's ops
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 2048, size=length).tolist() for length in (3, 15, 16, 40, 70)]
    n = 40
    got = _decode_batch(graphed, prompts, n, follow=True)
    assert graphed.runner.graphs.captured >= 2
    assert got == _decode_batch(eager, prompts, n)
    for prompt, tokens in zip(prompts, got):
        assert tokens == _generate(loaded, prompt, n)


def test_triton_kernels_in_bfloat16_keep_close_to_torch_ops() -> None:
    """In bfloat16 (what a GPU serves) the kernels round otherwise than torch's ops: the logits of a
    step of three prefills and of the decode step after it stay within bfloat16's tolerance of each
    other."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.bfloat16).to("cuda").eval()
    loaded = LoadedModel(model=model, config=model.config, name="tiny-bf16", device=torch.device("cuda"),
                         dtype=torch.bfloat16, eos_token_ids=[], max_model_len=256)
    rng = np.random.default_rng(3)
    inputs = [SeqInput(seq_id=i, tokens=rng.integers(1, 2048, size=length).tolist(), start=0, logits=True)
              for i, length in enumerate((5, 33, 64), start=1)]
    logits = {}
    for kernels in ("torch", "triton"):
        engine = Engine(loaded, num_blocks=64, gpu_kernels=kernels)
        assert engine.backend.endswith("+triton") == (kernels == "triton")
        for item in inputs:
            engine.tables.reserve(item.seq_id, len(item.tokens) + 1)
        with torch.inference_mode():
            prefill = engine.runner.forward(inputs)
            decode = engine.runner.forward([SeqInput(seq_id=item.seq_id, tokens=[7], start=len(item.tokens),
                                                     logits=True) for item in inputs])
        logits[kernels] = torch.cat([prefill, decode])
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0.05, atol=0.05)


def test_graph_batch_larger_than_buckets_falls_back_to_eager(loaded: LoadedModel) -> None:
    graphed = Engine(loaded, num_blocks=256, cuda_graph_batch=2)
    prompts = [[7, 8, 9, 10 + i] for i in range(3)]
    assert _decode_batch(graphed, prompts, 6) == [_generate(loaded, p, 6) for p in prompts]
    assert graphed.runner.graphs.captured == 0


def test_mask_bias_on_device_forces_the_allowed_token(loaded: LoadedModel) -> None:
    engine = Engine(loaded, num_blocks=64, cuda_graph_batch=4)
    driver = Driver(engine)
    words = np.zeros((2, -(-2048 // 32)), dtype="<u4")
    words[0, 1234 // 32] = 1 << (1234 % 32)
    words[1, 77 // 32] = 1 << (77 % 32)
    result = driver.step(
        [SeqStep(seq_id=1, tokens=[5, 6, 7], sampling=GREEDY, mask_row=1),
         SeqStep(seq_id=2, tokens=[5, 6, 8], sampling=GREEDY)],
        mask=words.tobytes(),
    )
    assert result.samples[1].token_id == 77
    result = driver.step([SeqStep(seq_id=1, tokens=[77], mask_row=0), SeqStep(seq_id=2, tokens=[9])],
                         mask=words.tobytes())
    assert result.samples[1].token_id == 1234
    assert result.samples[2].token_id == _generate(loaded, [5, 6, 8, 9], 1)[0]  # unmasked row untouched


MIXED = [
    SamplingParams(temperature=0, logit_bias={5: 3.0, 9: -100.0}),
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=1.0, top_k=20, seed=8, min_p=0.05),
    SamplingParams(temperature=0.7, top_p=0.9, seed=9, logprobs=3),
    SamplingParams(temperature=0, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, seed=10, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=3,
                   suppress=[2, 7], output_start=1),
]


def test_sampling_on_the_device_equals_the_host_and_waits_once() -> None:
    """Every kind of row at once (greedy, logit bias, seeded, top-k, top-p, penalties, min_tokens,
    alternatives): the same tokens as on the host (seeded draws come from host generators either way), and the only
    synchronizing operation is the copy of the results to the host."""
    torch.manual_seed(5)
    logits = torch.randn(len(MIXED), CONFIG["vocab_size"]) * 3
    histories = [[1, 2, 3], [], [4, 4], [5], [int(logits[4].argmax()), 9], [3, 7, 7]]
    on_host = sample(logits, [SeqSampler(p) for p in MIXED], histories)
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on_device = sample(on_gpu, [SeqSampler(p) for p in MIXED], histories)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [t.token_id for t in on_device] == [t.token_id for t in on_host]
    assert [t.logprob for t in on_device] == pytest.approx([t.logprob for t in on_host], abs=1e-4)
    assert [a.token_id for a in on_device[3].top] == [a.token_id for a in on_host[3].top]
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
