"""The KV-aware placement policy driving the scheduler core: prompts go where their prefix is
cached (as the workers' block events say), else where their first block hashes; a worker that left
is forgotten, a worker with no room for now is not."""

from __future__ import annotations

from common import wire
from common.blocks import prefix_keys
from services.scheduler.placement import KVAwarePlacement, rendezvous
from tests.scheduler.harness import EOS, VOCAB, Harness, prompt

SHARED = prompt(64)  # four full blocks


def _run_prefill(h: Harness, placement: KVAwarePlacement, rid: str) -> bytes:
    """Admit ``rid`` and run its prefill step, the worker reporting the blocks it registered."""
    (dispatch,) = [d for d in h.build() if any(getattr(o, "rid", None) == rid for o, _ in d.batch)]
    result = h.result(dispatch, blocks_new=list(prefix_keys(h.core.requests[rid].prompt)))
    placement.observe(dispatch.worker, dispatch.step, result)
    h.core.step_done(dispatch.worker, result)
    h.core.apply(dispatch, result)
    h.core.end_step()
    return dispatch.worker


def _hashed(tokens: list[int]) -> bytes:
    """Where a prompt nobody caches goes (of w1 and w2, both idle)."""
    first = next(prefix_keys(tokens))
    return max([b"w1", b"w2"], key=lambda w: rendezvous(w, first))


def test_a_shared_prefix_follows_its_blocks() -> None:
    placement = KVAwarePlacement(balance=8)
    h = Harness(place=placement)
    h.worker(b"w1")
    h.worker(b"w2")
    h.submit("a", SHARED + [5, 6], 4)
    holder = _run_prefill(h, placement, "a")
    assert holder == _hashed(SHARED)
    h.submit("b", SHARED + [7, 8, 9], 4)  # the same 64 leading tokens: where a's blocks are
    h.core.admit()
    assert h.core.requests["b"].worker == holder
    assert placement.figures[holder].placed == {"hash": 1, "prefix": 1}
    line = placement.worker_figures(h.core.pool.workers[holder])
    assert line.running == 2 and line.prefix_blocks_indexed == 4


def test_a_full_worker_keeps_its_index() -> None:
    placement = KVAwarePlacement(balance=8)
    h = Harness(place=placement, max_batch_size=1)
    h.worker(b"w1")
    h.worker(b"w2")
    h.submit("a", SHARED + [5, 6], 4)
    holder = _run_prefill(h, placement, "a")
    other = ({b"w1", b"w2"} - {holder}).pop()
    h.submit("c", SHARED + [7], 4)  # the holder is full: the other worker, with nothing cached
    h.core.admit()
    assert h.core.requests["c"].worker == other
    h.core.finish(h.core.requests["a"], "stop")
    h.submit("b", SHARED + [8], 4)  # the holder has room again, and its cache is still known
    h.core.admit()
    assert h.core.requests["b"].worker == holder and placement.figures[holder].placed["prefix"] == 1


def test_a_lost_worker_leaves_the_index() -> None:
    placement = KVAwarePlacement()
    h = Harness(place=placement, worker_gone=placement.forget)
    h.worker(b"w1")
    h.worker(b"w2")
    h.submit("a", SHARED + [5], 4)
    holder = _run_prefill(h, placement, "a")
    h.core.worker_lost(holder, "gone")
    assert placement.index.blocks(holder) == 0 and holder not in placement.figures
    h.submit("b", SHARED + [6], 4)
    h.core.admit()
    other = ({b"w1", b"w2"} - {holder}).pop()
    assert h.core.requests["b"].worker == other and placement.figures[other].placed == {"hash": 1}


def test_batch_size_and_step_budget_are_per_worker() -> None:
    h = Harness(max_batch_size=1, step_token_budget=16, prefill_chunk_tokens=16)
    h.worker(b"w1")
    h.worker(b"w2")
    for rid in "abc":
        h.submit(rid, prompt(32, start=13 + "abc".index(rid)), 4)
    steps = h.build()
    assert sorted(h.core.requests[rid].state.value for rid in "abc").count("queued") == 1
    assert sorted(len(s.tokens) for d in steps for s in d.step.seqs) == [16, 16]  # a full chunk on each worker


def test_a_step_is_built_for_the_workers_asked_only() -> None:
    """The per-worker pipelines: a fast worker's next steps go out while a slow one's is still running."""
    h = Harness(place=KVAwarePlacement())
    h.worker(b"w1")
    h.worker(b"w2")
    h.submit("a", prompt(5), 8)
    h.submit("b", prompt(6, start=20), 8)
    h.core.admit()
    fast = h.core.requests["a"].worker
    slow = h.core.requests["b"].worker
    assert fast != slow
    (first,) = h.core.build_steps(None, {fast})
    assert first.worker == fast and h.core.requests["b"].in_flight == 0
    (slow_step,) = h.core.build_steps(None, {slow})
    for _ in range(3):  # the fast worker's results come back and its next steps go, the slow one's still out
        h.apply([first])
        (first,) = h.core.build_steps(None, {fast})
        assert first.step.slot_ids() == [h.core.requests["a"].seq_id]
    h.apply([first, slow_step])
    a, b = h.core.requests["a"], h.core.requests["b"]
    assert len(a.generated) == 4 and len(b.generated) == 1
    h.core.finish(b, "cancelled")  # its free waits for the slow worker's next step
    assert [d.worker for d in h.core.build_steps(None, {fast})] == [fast]
    (freeing,) = h.core.build_steps(None, {slow})
    assert freeing.step.free == [b.seq_id]


def test_a_prompt_placed_before_its_block_events_draws_the_next_sharing_it() -> None:
    """The index counts a prompt on its worker from the moment it is placed: a request sharing its
    prefix that comes before any prefill ran goes there, not where the prefix's first block hashes."""
    placement = KVAwarePlacement(balance=0)
    h = Harness(place=placement)
    hashed = h.worker(_hashed(SHARED))  # registered first: a short prompt goes there on a tie
    other = h.worker(({b"w1", b"w2"} - {hashed}).pop())
    h.submit("short", prompt(5), 4)
    h.submit("a", SHARED + [5], 4)  # the hashed worker runs one more: with balance 0, the other one
    h.core.admit()
    assert h.core.requests["short"].worker == hashed and h.core.requests["a"].worker == other
    assert placement.index.blocks(other) == 0  # nothing reported yet
    h.submit("b", SHARED + [6, 7], 4)  # both run one now: where a went, its prefix promised there
    h.core.admit()
    assert h.core.requests["b"].worker == other
    assert placement.figures[other].placed == {"hash": 1, "prefix": 1}


def test_a_workers_line_says_which_forward_it_runs_and_why_not_the_native_one() -> None:
    placement = KVAwarePlacement(balance=8)
    h = Harness(place=placement)
    h.core.worker_hello(b"w1", wire.WorkerHello(
        worker_id="w1", stage="ready", vocab_size=len(VOCAB), max_model_len=2048, eos_token_ids=[EOS],
        kv_capacity_tokens=4096, forward="transformers", fallback_reason="model type 'gpt2' has no native forward",
        wire_version=wire.WIRE_VERSION))
    line = placement.worker_figures(h.core.pool.workers[b"w1"])
    assert line.forward == "transformers" and "gpt2" in line.fallback_reason
