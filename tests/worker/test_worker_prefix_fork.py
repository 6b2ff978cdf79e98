"""Engine primitives on the real default model: prefix reuse across requests, forks (copy-on-write),
rollback, fast-forward and eviction under a tiny pool."""

from __future__ import annotations

import pytest
import torch

from common.blocks import prefix_keys
from common.wire import SamplingParams, SeqStep, Step
from services.worker.engine import Engine
from services.worker.kv_cache import ROOT_HASH, block_hash
from tests.worker.conftest import GREEDY, Driver

NEW = 6
LONG_TEXT = (
    "The lighthouse stood on a rock at the edge of the northern sea. Every night the keeper climbed the "
    "spiral stairs, trimmed the wick, polished the great lens and watched the beam sweep across the water. "
    "Ships passed far out, their lights small and steady, and the keeper wrote each one in a worn logbook."
)


@pytest.fixture(scope="module")
def long_prefix(tokenizer) -> list[int]:
    ids = tokenizer(LONG_TEXT).input_ids
    assert len(ids) >= 48
    return ids


@pytest.fixture(scope="module")
def own_engine(loaded) -> Engine:
    """An engine of its own, so block counts are not disturbed by other tests."""
    return Engine(loaded, num_blocks=64)


@pytest.fixture
def drv(own_engine: Engine) -> Driver:
    return Driver(own_engine)


def _blocks(engine: Engine, seq_id: int) -> list[int]:
    return list(engine.tables.seqs[seq_id])


def _logits(engine: Engine, context: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.loaded.model(torch.tensor([context])).logits[0, -1].float()


def test_prefix_reuse_gives_the_same_greedy_tokens(drv: Driver, long_prefix, tokenizer, reference) -> None:
    engine = drv.engine
    first = long_prefix + tokenizer(" One stormy night").input_ids
    second = long_prefix + tokenizer(" In the morning, a").input_ids
    want = reference(second, NEW)
    # The first request stays live while the second arrives: its blocks are shared.
    result = drv.step([SeqStep(seq_id=1, tokens=first, sampling=GREEDY)])
    assert result.cached_tokens == {}
    shared = len(long_prefix) // 16 * 16
    result = drv.step([SeqStep(seq_id=2, tokens=second, sampling=GREEDY)])
    assert result.cached_tokens == {2: shared}
    assert _blocks(engine, 2)[: shared // 16] == _blocks(engine, 1)[: shared // 16]
    tokens = [result.samples[2].token_id]
    while len(tokens) < NEW:
        tokens.append(drv.step([SeqStep(seq_id=2, tokens=[tokens[-1]])]).samples[2].token_id)
    assert tokens == want
    # Both freed: the blocks stay cached, and a third request in chunks (not aligned to blocks)
    # is served from them, chunk by chunk, with the same output.
    engine.free([1, 2])
    stats = engine.stats()
    assert stats.kv_blocks_cached >= shared // 16 and stats.kv_blocks_used == 0
    for i in range(0, len(second), 20):
        chunk = second[i : i + 20]
        last = i + 20 >= len(second)
        result = drv.step([SeqStep(seq_id=3, tokens=chunk, sample=last, sampling=GREEDY if i == 0 else None)])
        assert not result.failures
        # Each chunk takes the cached blocks it completes (replacing the partial block the last
        # chunk computed); when sampling, the block of its last token is computed.
        limit = len(second) - 1 if last else i + 20
        assert result.cached_tokens.get(3, 0) == max(0, limit // 16 * 16 - i)
    tokens = [result.samples[3].token_id]
    while len(tokens) < NEW:
        tokens.append(drv.step([SeqStep(seq_id=3, tokens=[tokens[-1]])]).samples[3].token_id)
    engine.free([3])
    assert tokens == want
    assert engine.stats().prefix_hit_rate > 0


def test_fork_continues_like_an_unforked_copy(drv: Driver, long_prefix, reference) -> None:
    engine = drv.engine
    prompt = long_prefix[:40]
    want = reference(prompt, 2 * NEW)
    result = drv.step([SeqStep(seq_id=10, tokens=prompt, sampling=GREEDY)])
    out = [result.samples[10].token_id]
    for _ in range(NEW - 1):
        out.append(drv.step([SeqStep(seq_id=10, tokens=[out[-1]])]).samples[10].token_id)
    # Length 40 + 5 = 45: two full blocks and a partial third, all shared by the fork.
    used = engine.stats().kv_blocks_used
    result = drv.step(
        [
            SeqStep(seq_id=11, tokens=[], fork_of=10),  # sample again after the parent's last token
            SeqStep(seq_id=12, tokens=[out[-1]], fork_of=10),
            SeqStep(seq_id=10, tokens=[out[-1]]),
        ]
    )
    assert not result.failures
    assert result.samples[11].token_id == out[-1]
    assert result.samples[10].token_id == result.samples[12].token_id == want[NEW]
    parent, fork = _blocks(engine, 10), _blocks(engine, 12)
    assert parent[:2] == fork[:2] and parent[2] != fork[2]  # the partial tail was copied on write
    assert all(engine.tables.allocator.refcount(b) == 3 for b in parent[:2])
    # 11 recomputed the partial tail's last token (a copy), 12 or 10 copied it: 2 new blocks.
    assert engine.stats().kv_blocks_used == used + 2
    outs = {10: [result.samples[10].token_id], 12: [result.samples[12].token_id]}
    for _ in range(NEW - 1):
        result = drv.step([SeqStep(seq_id=i, tokens=[outs[i][-1]]) for i in outs])
        for i in outs:
            outs[i].append(result.samples[i].token_id)
    engine.free([10, 11, 12])
    assert outs[10] == outs[12] == want[NEW:]


def test_forks_diverge_with_their_seeds_while_sharing_blocks(drv: Driver, long_prefix) -> None:
    engine = drv.engine
    hot = SamplingParams(temperature=1.0, seed=11)

    def run(base: int) -> dict[int, list[int]]:
        result = drv.step([SeqStep(seq_id=base, tokens=long_prefix[:32], sampling=hot, sample=False)])
        shared = _blocks(engine, base)
        seqs = [
            SeqStep(seq_id=base + 1, tokens=[], fork_of=base, sampling=SamplingParams(temperature=1.0, seed=1)),
            SeqStep(seq_id=base + 2, tokens=[], fork_of=base, sampling=SamplingParams(temperature=1.0, seed=2)),
            SeqStep(seq_id=base + 3, tokens=[], fork_of=base),  # inherits, reseeded from the parent
            SeqStep(seq_id=base + 4, tokens=[], fork_of=base),
        ]
        result = drv.step(seqs)
        assert not result.failures
        # 32 tokens = two full blocks: the first shared by all five; each fork computed its last
        # token again, into a copy of the second.
        for i in range(1, 5):
            assert _blocks(engine, base + i)[:1] == shared[:1]
        assert engine.tables.allocator.refcount(shared[0]) == 5
        outs = {base + i: [result.samples[base + i].token_id] for i in range(1, 5)}
        for _ in range(10):
            result = drv.step([SeqStep(seq_id=i, tokens=[o[-1]]) for i, o in outs.items()])
            for i, o in outs.items():
                o.append(result.samples[i].token_id)
        engine.free([base, *outs])
        return {i - base: o for i, o in outs.items()}

    first = run(20)
    assert first[1] != first[2] and first[3] != first[4]
    assert run(30) == first  # the reseeding is deterministic


def test_rollback_then_refeed_equals_never_decoding(drv: Driver, long_prefix) -> None:
    engine = drv.engine
    prompt = long_prefix[:27]
    params = SamplingParams(temperature=0, logprobs=3)
    result = drv.step([SeqStep(seq_id=40, tokens=prompt, sampling=params)])
    samples = [result.samples[40]]
    for _ in range(9):  # 27 + 9 = 36 tokens fed: the sequence crosses the block boundary at 32
        samples.append(drv.step([SeqStep(seq_id=40, tokens=[samples[-1].token_id])]).samples[40])
    ids = [s.token_id for s in samples]
    # Roll back 7 (to 29, inside the second block) and sample there again: as at that point before.
    result = drv.step([SeqStep(seq_id=40, tokens=[], backtrack=7)])
    assert result.samples[40].token_id == ids[2]
    assert result.samples[40].logprob == pytest.approx(samples[2].logprob, abs=1e-4)
    # Fast-forward the same tokens again in one step, then decode: the same as never rolled back.
    result = drv.step([SeqStep(seq_id=40, tokens=ids[2:9])])
    assert result.samples[40].token_id == ids[9]
    assert [t.token_id for t in result.samples[40].top] == [t.token_id for t in samples[9].top]
    assert result.samples[40].logprob == pytest.approx(samples[9].logprob, abs=1e-4)
    # Roll back and feed a different continuation: logits as for a fresh context.
    other = [ids[0], 13, 42]
    result = drv.step([SeqStep(seq_id=40, tokens=other, backtrack=9)])
    assert len(engine.seqs[40].tokens) == 27 + 3
    want = _logits(engine, prompt + other)
    assert result.samples[40].token_id == int(want.argmax())
    assert result.samples[40].logprob == pytest.approx(float(want.log_softmax(-1).max()), abs=1e-4)
    # Too far back fails only that sequence.
    result = drv.step(
        [SeqStep(seq_id=40, tokens=[1], backtrack=31), SeqStep(seq_id=41, tokens=prompt, sampling=GREEDY)]
    )
    assert [f.seq_id for f in result.failures] == [40] and "backtrack" in result.failures[0].message
    assert 41 in result.samples and 40 not in engine.seqs
    engine.free([41])


def test_copy_on_write_keeps_parent_and_fork_apart(drv: Driver, long_prefix) -> None:
    """Parent and fork write different tokens into their shared partial block, the fork first
    (it copies), then the parent (now the sole holder, in place): each sees only its own."""
    engine = drv.engine
    prompt = long_prefix[:21]  # a full block and 5 tokens of a shared partial one
    drv.step([SeqStep(seq_id=50, tokens=prompt, sampling=GREEDY, sample=False)])
    tail = _blocks(engine, 50)[1]
    x, y = 300, 4000
    result = drv.step([SeqStep(seq_id=51, tokens=[y, 7], fork_of=50)])
    assert _blocks(engine, 51)[1] != tail and engine.tables.allocator.refcount(tail) == 1
    got_fork = [result.samples[51].token_id]
    want = _logits(engine, prompt + [y, 7]).log_softmax(-1)
    assert result.samples[51].logprob == pytest.approx(float(want.max()), abs=1e-4)
    result = drv.step([SeqStep(seq_id=50, tokens=[x, 7])])
    assert _blocks(engine, 50)[1] == tail
    got_parent = [result.samples[50].token_id]
    want = _logits(engine, prompt + [x, 7]).log_softmax(-1)
    assert result.samples[50].logprob == pytest.approx(float(want.max()), abs=1e-4)
    for _ in range(3):
        result = drv.step([SeqStep(seq_id=50, tokens=[got_parent[-1]]), SeqStep(seq_id=51, tokens=[got_fork[-1]])])
        got_parent.append(result.samples[50].token_id)
        got_fork.append(result.samples[51].token_id)
    engine.free([50, 51])
    want_parent = Driver(engine).generate(52, prompt + [x, 7], 4)
    want_fork = Driver(engine).generate(53, prompt + [y, 7], 4)
    assert got_parent == want_parent and got_fork == want_fork


def test_fork_of_unknown_or_existing_fails_only_that_sequence(drv: Driver, long_prefix) -> None:
    engine = drv.engine
    result = drv.step(
        [
            SeqStep(seq_id=60, tokens=long_prefix[:5], sampling=GREEDY),
            SeqStep(seq_id=61, tokens=[], fork_of=60),  # 60 did not exist before this step
            SeqStep(seq_id=62, tokens=[5], fork_of=999),
        ]
    )
    assert sorted(f.seq_id for f in result.failures) == [61, 62]
    assert "unknown" in result.failures[0].message and 60 in result.samples
    result = drv.step([SeqStep(seq_id=63, tokens=[], fork_of=60, sample=False)])  # empty without sampling
    assert [f.seq_id for f in result.failures] == [63]
    engine.free([60])
    assert engine.stats().active_seqs == 0 and engine.stats().kv_blocks_used == 0


def test_eviction_under_a_tiny_pool_keeps_greedy_output_and_goes_lru(loaded, long_prefix, tokenizer, reference):
    engine = Engine(loaded, num_blocks=1 + 8)  # 8 blocks: 128 tokens
    drv = Driver(engine)
    other = tokenizer("Once upon a time, in a small village by the river, there lived an old clockmaker " * 3).input_ids
    a, b, c = long_prefix[:48], other[:48], (long_prefix[::-1] + other)[:64]
    n = 4  # 48 + 3 fed = 51 tokens: 4 blocks, 3 of them full and named
    want = {name: reference(p, n) for name, p in (("a", a), ("b", b), ("c", c))}
    assert drv.generate(1, a, n) == want["a"]
    assert drv.generate(2, b, n) == want["b"]
    stats = engine.stats()
    assert (stats.kv_blocks_cached, stats.kv_blocks_free) == (6, 2)
    assert (stats.kv_cached_tokens, stats.kv_free_tokens, stats.kv_used_tokens) == (6 * 16, 2 * 16, 0)
    # c needs 5 blocks: the 2 free, then 3 cached ones, a's (released before b's).
    assert drv.generate(3, c, n) == want["c"]
    assert engine.tables.allocator.lookup(block_hash(ROOT_HASH, a[:16])) is None
    assert engine.tables.allocator.lookup(block_hash(ROOT_HASH, b[:16])) is not None
    assert engine.stats().kv_evictions == 3
    # b is served from what is left of it, a from scratch; both still right.
    result = drv.step([SeqStep(seq_id=4, tokens=b, sampling=GREEDY)])
    assert result.cached_tokens == {4: 32}
    engine.free([4])
    result = drv.step([SeqStep(seq_id=5, tokens=a, sampling=GREEDY)])
    assert result.cached_tokens == {}
    engine.free([5])
    assert drv.generate(6, a, n) == want["a"] and drv.generate(7, b, n) == want["b"]


def test_fork_and_backtrack_on_the_transformers_fallback(loaded, long_prefix, reference) -> None:
    engine = Engine(loaded, num_blocks=16, native=False)
    drv = Driver(engine)
    prompt = long_prefix[:20]
    want = reference(prompt, 4)
    result = drv.step([SeqStep(seq_id=1, tokens=prompt + want[:2], sampling=GREEDY)])
    assert result.samples[1].token_id == want[2] and result.cached_tokens == {}
    result = drv.step([SeqStep(seq_id=2, tokens=[], fork_of=1, backtrack=2), SeqStep(seq_id=1, tokens=[want[2]])])
    assert result.samples[2].token_id == want[0] and result.samples[1].token_id == want[3]
    result = drv.step([SeqStep(seq_id=2, tokens=want[:3])])
    assert result.samples[2].token_id == want[3]
    engine.free([1, 2])


def test_step_results_carry_block_events(driver) -> None:
    """The blocks a step registers and the cache forgets come back as block keys, the same keys
    the scheduler computes from a prompt (common.blocks.prefix_keys)."""
    prompt = list(range(300, 340))  # two full blocks and a partial one
    result = driver.step([SeqStep(seq_id=900, tokens=prompt, sampling=GREEDY)])
    assert result.blocks_new == list(prefix_keys(prompt)) and result.blocks_gone == []
    driver.step([], free=[900])
    assert driver.engine.drop_prefix_cache() >= 2
    result = driver.step([])
    assert set(result.blocks_gone) >= set(prefix_keys(prompt)) and result.blocks_new == []
    assert result.kv_cached_tokens == 0
    driver.step([SeqStep(seq_id=901, tokens=prompt, sampling=GREEDY)])
    driver.step_id += 1
    result = driver.engine.step(Step(step_id=driver.step_id, seqs=[], free_all=True))
    assert set(result.blocks_new) >= set(prefix_keys(prompt)) and result.kv_cached_tokens >= 32
