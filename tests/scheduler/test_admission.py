"""Admission: refusals, the KV budget, the batch limit, priority order and placement."""

import pytest

from common import wire
from common.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, MEMORY_PRESSURE, MODEL_LOADING_ERROR, RATE_LIMITED
from services.scheduler.batch_ceiling import MIN_STEPS
from services.scheduler.requests import State
from tests.scheduler.harness import Harness, prompt, seqs_of


def test_a_request_is_queued_then_admitted_onto_the_worker():
    h = Harness()
    h.worker()
    reply = h.submit("r1", prompt(5))
    assert reply == wire.Queued(rid="r1", waiting=1)
    assert h.core.requests["r1"].state is State.QUEUED
    steps = h.build()
    assert [d.worker for d in steps] == [b"w1"]
    assert h.core.requests["r1"].state is State.RUNNING
    assert h.core.pool.workers[b"w1"].reserved_tokens == 32  # 5 + 16 tokens, in whole 16-token blocks


def test_refusals_name_the_problem_and_change_nothing():
    h = Harness()
    h.worker(max_model_len=64)
    h.submit("dup", prompt(3))
    cases = {
        "dup": (prompt(3), 4, INVALID_REQUEST, "already live"),
        "empty": ([], 4, INVALID_REQUEST, "no tokens"),
        "vocab": ([9999], 4, INVALID_REQUEST, "must lie in"),
        "long": (prompt(64), 4, CONTEXT_LENGTH_EXCEEDED, "the model's context of 64 tokens leaves no room"),
        "negative": (prompt(3), -1, INVALID_REQUEST, "max_tokens must be >= 0"),
    }
    for rid, (ids, max_tokens, code, words) in cases.items():
        reply = h.submit(rid, ids, max_tokens)
        assert isinstance(reply, wire.Error) and reply.code == code and words in reply.message, (rid, reply)
        assert reply.rid == rid
    assert list(h.core.requests) == ["dup"]


def test_a_prefill_only_request_may_fill_the_whole_context():
    h = Harness()
    h.worker(max_model_len=64)
    assert isinstance(h.submit("score", prompt(64), 0), wire.Queued)


def test_a_full_queue_answers_memory_pressure():
    h = Harness(max_queued=2)
    for rid in ("a", "b"):
        assert isinstance(h.submit(rid, prompt(3)), wire.Queued)
    reply = h.submit("c", prompt(3))
    assert isinstance(reply, wire.Error) and reply.code == MEMORY_PRESSURE


def test_a_worker_that_failed_to_load_refuses_with_model_loading_error():
    h = Harness()
    h.worker(stage="failed")
    reply = h.submit("r", prompt(3))
    assert isinstance(reply, wire.Error) and reply.code == MODEL_LOADING_ERROR and "boom" in reply.message


def test_requests_queue_until_a_worker_is_ready():
    h = Harness()
    h.submit("r", prompt(3))
    assert h.build() == []
    h.worker(stage="loading")
    assert h.build() == []
    h.worker()
    assert seqs_of(h.build(), "r")


def test_the_kv_budget_admits_what_fits_and_queues_the_rest():
    h = Harness()
    h.worker(capacity=100)
    for rid in ("a", "b", "c"):
        h.submit(rid, prompt(10), 30)  # 40 tokens each: 48 in whole blocks
    steps = h.build()
    assert seqs_of(steps, "a") and seqs_of(steps, "b") and not seqs_of(steps, "c")
    assert h.core.requests["c"].state is State.QUEUED
    h.core.control(b"gw", wire.Cancel(rid="a"))
    assert h.core.pool.workers[b"w1"].reserved_tokens == 48
    h.core.admit()
    assert h.core.requests["c"].state is State.RUNNING


def test_kv_is_reserved_in_whole_blocks_as_the_worker_allocates_it():
    """Three sequences of 17 tokens fit a 64-token pool counted in tokens (51), but take two 16-token blocks
    each on the worker (6 blocks of its 4): the third waits, rather than fail the worker's step with its pool
    exhausted."""
    h = Harness()
    h.worker(capacity=64)
    for rid in ("a", "b", "c"):
        h.submit(rid, prompt(10), 7)
    steps = h.build()
    assert seqs_of(steps, "a") and seqs_of(steps, "b") and not seqs_of(steps, "c")
    assert h.core.pool.workers[b"w1"].reserved_tokens == 64


def test_max_tokens_beyond_the_context_is_refused_not_cut():
    h = Harness()
    h.worker(max_model_len=64)
    reply = h.submit("r", prompt(10), 55)
    assert isinstance(reply, wire.Error) and reply.code == CONTEXT_LENGTH_EXCEEDED
    assert reply.message == ("the prompt (10 tokens) plus max_tokens (55) exceeds the model's context of 64 tokens; "
                             "ask for at most 54")
    assert isinstance(h.submit("fits", prompt(10), 54), wire.Queued)
    assert h.core.requests["fits"].submit.max_tokens == 54


def test_max_tokens_beyond_the_kv_pool_is_refused_not_cut():
    h = Harness()
    h.worker(capacity=50)
    reply = h.submit("r", prompt(10), 100)
    assert isinstance(reply, wire.Error) and reply.code == CONTEXT_LENGTH_EXCEEDED
    assert "exceeds the KV cache of 50 tokens; ask for at most 40" in reply.message
    reply = h.submit("huge", prompt(50), 4)
    assert isinstance(reply, wire.Error) and "the KV cache of 50 tokens leaves no room" in reply.message


def test_the_batch_size_limit_holds_requests_back():
    h = Harness(max_batch_size=2)
    h.worker()
    for rid in ("a", "b", "c"):
        h.submit(rid, prompt(3))
    h.build()
    assert [r.rid for r in h.core.queue] == ["c"]


def test_priority_goes_first_and_nothing_jumps_a_blocked_head():
    h = Harness()
    h.worker(capacity=100)
    h.submit("batch", prompt(10), 20, priority=5)
    h.submit("big", prompt(10), 85, priority=1)
    h.submit("small", prompt(5), 5, priority=3)
    h.build()
    # "big" (priority 1) is admitted first; "small" (3) fits beside it; "batch" (5) no longer does
    assert h.core.requests["big"].state is State.RUNNING
    assert h.core.requests["small"].state is State.QUEUED  # 95 + 10 > 100: it waits, and so does what follows
    assert h.core.requests["batch"].state is State.QUEUED


def test_a_paused_queued_request_is_skipped_until_resumed():
    h = Harness()
    h.worker()
    h.submit("p", prompt(3))
    h.submit("q", prompt(3))
    h.core.control(b"gw", wire.Pause(rid="p"))
    h.build()
    assert h.core.requests["p"].state is State.QUEUED and h.core.requests["q"].state is State.RUNNING
    h.core.control(b"gw", wire.Resume(rid="p"))
    assert seqs_of(h.build(), "p")


def test_the_placement_policy_picks_the_worker_of_a_new_sequence():
    calls = []

    def last_worker(request, workers):
        calls.append((request.rid, request.needed_tokens, sorted(w.identity for w in workers)))
        return workers[-1].identity

    h = Harness(place=last_worker)
    h.worker(b"w1")
    h.worker(b"w2")
    h.submit("r", prompt(4), 6)
    steps = h.build()
    assert calls == [("r", 16, [b"w1", b"w2"])]  # 10 tokens, in whole blocks
    assert [d.worker for d in steps] == [b"w2"] and h.core.requests["r"].worker == b"w2"


def test_the_default_placement_takes_the_least_loaded_worker():
    h = Harness()
    h.worker(b"w1", capacity=1000)
    h.worker(b"w2", capacity=1000)
    h.submit("a", prompt(10), 90)
    h.submit("b", prompt(10), 40)
    h.submit("c", prompt(10), 10)
    h.build()
    workers = {rid: h.core.requests[rid].worker for rid in "abc"}
    assert workers["a"] != workers["b"] and workers["c"] == workers["b"]


def test_the_first_step_to_a_worker_drops_what_it_held():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3))
    first = h.build()
    assert first[0].step.free_all
    h.apply(first)
    assert not h.build()[0].step.free_all


def test_a_user_at_their_generations_quota_is_refused_and_others_are_not():
    h = Harness(generations_per_user=2)
    h.worker()
    assert isinstance(h.submit("a1", prompt(3), 2, tenant="alice"), wire.Queued)
    assert isinstance(h.submit("a2", prompt(3), 2, tenant="alice"), wire.Queued)
    refused = h.submit("a3", prompt(3), 2, tenant="alice")
    assert isinstance(refused, wire.Error) and refused.code == RATE_LIMITED
    assert "tenants.max_generations_per_user = 2" in refused.message and "a3" not in h.core.requests
    assert isinstance(h.submit("b1", prompt(3), 2, tenant="bob"), wire.Queued)
    assert isinstance(h.submit("n1", prompt(3), 2), wire.Queued)  # no tenant named: not counted
    h.run({"a1": [1, 2]})  # one of alice's ends: she may start another
    assert isinstance(h.submit("a3", prompt(3), 2, tenant="alice"), wire.Queued)


def _decode_steps(h: Harness, steps: int) -> None:
    """``steps`` cycles whose forward time grows as the rows (a saturated CPU: no batch runs faster)."""
    for _ in range(steps):
        for dispatch in h.build():
            rows = len(dispatch.followers) + len(dispatch.batch)
            result = h.result(dispatch, forward_ms=10.0 * rows)
            h.core.step_done(dispatch.worker, result)
            h.core.apply(dispatch, result)
        h.core.end_step()
        h.core.emit_deferred()


@pytest.mark.parametrize("adaptive", [True, False])
def test_admission_stops_at_the_batch_past_which_a_worker_runs_no_faster(adaptive):
    h = Harness(max_batch_size=9, adaptive_batch=adaptive)
    h.worker()
    for rid in ("a1", "a2", "a3", "a4"):
        h.submit(rid, prompt(3), 100)
    _decode_steps(h, MIN_STEPS + 1)  # the first step feeds the prompts: only decode steps count
    for rid in ("b1", "b2", "b3", "b4"):
        h.submit(rid, prompt(3), 100)
    _decode_steps(h, MIN_STEPS + 1)  # 8 rows cost twice 4 rows: twice the batch, no more tokens a second
    h.submit("late", prompt(3), 100)
    h.build()
    late = h.core.requests["late"].state
    if adaptive:
        assert h.core.pool.workers[b"w1"].batch.ceiling == 4 and late is State.QUEUED  # 8 run, 4 would do
    else:
        assert h.core.pool.workers[b"w1"].batch is None and late is State.RUNNING  # max_batch_size 9 only
