"""A worker of two tensor-parallel ranks (gloo, fp32) as real processes: its greedy tokens equal
the single-rank engine's on the same dense weights and torch's ops (what a rank runs) token for
token, through prefill, batched decode (a steered sequence among them: the followers get its vector from the
Step), prefix-cache hits, forks and masks that follow their step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoConfig

from common import wire
from common.model_source import resolve_model
from common.config import Settings
from common.steering import SteeringVector, encode, vector_id
from services.worker.engine import Engine
from services.worker.model_loader import LoadedModel
from services.worker.layers.parallel import Shard, split
from tests.worker.conftest import GREEDY, Driver
from tests.worker.test_worker_service import Scheduler, _start_worker, _stop, scheduler  # noqa: F401 (fixture)

TOKENS = 24


def test_split_covers_everything_evenly() -> None:
    assert [split(9, 2, i) for i in range(2)] == [(0, 5), (5, 9)]
    assert [split(3, 3, i) for i in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [split(1536, 4, i) for i in range(4)] == [(0, 384), (384, 768), (768, 1152), (1152, 1536)]


def test_shards_follow_key_value_head_groups() -> None:
    config = AutoConfig.from_pretrained(resolve_model(Settings()).directory)  # 9 heads, 3 KV heads
    first, second = (Shard.plan(config, rank, 2) for rank in range(2))
    assert (first.heads, first.kv_heads, first.columns) == ((0, 6), (0, 2), (0, 768))
    assert (second.heads, second.kv_heads, second.columns) == ((6, 9), (2, 3), (768, 1536))
    with pytest.raises(ValueError, match="at least 4 key/value heads"):
        Shard.plan(config, 0, 4)


@pytest.fixture(scope="module")
def dense_engine(loaded: LoadedModel) -> Engine:
    """One rank's engine: the dense weights on torch's matmuls and ops, as tensor parallel shards
    them (not Tiller's kernel's tiles, which round otherwise)."""
    return Engine(dataclasses.replace(loaded, linears=None, kernel=False), num_blocks=256)


def _steered(seq_id: int, prompt: list[int], hidden: int) -> wire.SeqStep:
    """``prompt`` under a vector on two layers, strong enough to change the greedy tokens."""
    rng = np.random.default_rng(0)
    vector = SteeringVector.of({layer: rng.standard_normal(hidden) for layer in (3, 20)})
    data = encode(vector)
    return wire.SeqStep(seq_id=seq_id, tokens=prompt, sampling=GREEDY, cache_domain="steered",
                        steering=[wire.SteeringTerm(vector=vector_id(data), scale=1.0)], vectors={vector_id(data): data})


def _request(scheduler: Scheduler, step: wire.Step, mask: bytes | None = None) -> dict[int, wire.SampledToken]:
    """Send ``step`` (and its StepMasks with ``mask``), and return its samples."""
    if mask is None:
        result = scheduler.request(step)
    else:
        scheduler.send(wire.encode(step))
        result = scheduler.request(wire.StepMasks(step_id=step.step_id), mask)
    assert isinstance(result, wire.StepResult) and not result.failures, result
    return wire.samples_by_seq(step, result)


def test_two_ranks_generate_what_one_does(tmp_path: Path, scheduler: Scheduler, dense_engine, tokenizer) -> None:
    prompts = [tokenizer(text).input_ids for text in ("The capital of France is", "def fibonacci(n):\n    ")]
    shared = tokenizer("A long shared preamble about the history of the Roman empire and its many emperors, "
                       "which ruled for centuries over the Mediterranean world.").input_ids
    driver = Driver(dense_engine)
    expected = [driver.generate(100 + i, p, TOKENS) for i, p in enumerate(prompts)]
    expected_shared = driver.generate(110, shared + prompts[0], TOKENS)
    hidden = dense_engine.loaded.config.hidden_size
    steered = [driver.step([_steered(120, prompts[0], hidden)]).samples[120].token_id]
    while len(steered) < TOKENS:
        steered.append(driver.step([], follows=[120]).samples[120].token_id)
    dense_engine.free([120])
    assert steered != expected[0]

    process = _start_worker(tmp_path, TILLER_DISTRIBUTED__TENSOR_PARALLEL="2")
    try:
        hello = scheduler.wait_for_stage("ready", timeout_s=600)  # two ranks load the model side by side
        assert hello.kv_capacity_tokens >= 4 * 2048
        # Both prompts in one step, then batched decode steps.
        seqs = [wire.SeqStep(seq_id=i, tokens=p, sampling=GREEDY) for i, p in enumerate(prompts)]
        samples = _request(scheduler, wire.Step(step_id=1, seqs=seqs + [_steered(2, prompts[0], hidden)]))
        got = {i: [samples[i].token_id] for i in range(3)}
        for step_id in range(2, TOKENS + 1):  # they follow: each rank feeds its own last samples
            samples = _request(scheduler, wire.Step(step_id=step_id, seqs=[], follows=wire.pack_ids([0, 1, 2])))
            for i in range(3):
                got[i].append(samples[i].token_id)
        assert [got[0], got[1], got[2]] == expected + [steered]

        # A prompt whose leading blocks the cache holds (after a first sequence computed them), a
        # fork of it, and a step whose masks follow it (a mask allowing only the expected token).
        result = scheduler.request(wire.Step(step_id=50, seqs=[wire.SeqStep(seq_id=5, tokens=shared, sampling=GREEDY)]))
        assert not result.failures
        step = wire.Step(step_id=51, seqs=[wire.SeqStep(seq_id=6, tokens=shared + prompts[0], sampling=GREEDY)], free=[5])
        result = scheduler.request(step)
        assert not result.failures and result.cached_tokens[6] >= 16
        tokens = [wire.samples_by_seq(step, result)[6].token_id]
        samples = _request(scheduler, wire.Step(step_id=52, seqs=[wire.SeqStep(seq_id=7, fork_of=6, tokens=[tokens[-1]])]))
        fork_tokens = [samples[7].token_id]
        words = -(-hello.vocab_size // 32)
        for step_id in range(53, 53 + TOKENS - 1):
            seqs = [wire.SeqStep(seq_id=6, tokens=[tokens[-1]], mask_row=0), wire.SeqStep(seq_id=7, tokens=[fork_tokens[-1]])]
            mask = bytearray(4 * words)
            target = expected_shared[len(tokens)]
            mask[4 * (target // 32) : 4 * (target // 32) + 4] = (1 << (target % 32)).to_bytes(4, "little")
            samples = _request(scheduler, wire.Step(step_id=step_id, seqs=seqs, masks_follow=True), bytes(mask))
            tokens.append(samples[6].token_id)
            fork_tokens.append(samples[7].token_id)
        assert tokens == expected_shared
        assert ([tokens[0]] + fork_tokens)[:TOKENS] == expected_shared  # greedy: the fork goes on as its parent would
        assert process.poll() is None
    finally:
        _stop(process)
