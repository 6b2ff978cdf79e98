"""Workers joining, loading and being lost: what fails, what waits, what is forgotten."""

import pytest

from common import wire
from common.errors import SERVICE_UNAVAILABLE
from services.scheduler.requests import State
from tests.scheduler.harness import HE, LLO, Harness, prompt


def test_a_lost_worker_fails_its_running_requests_as_retryable():
    h = Harness(max_batch_size=1)
    h.worker()
    h.submit("run", prompt(3), 10)
    h.submit("wait", prompt(3), 10)
    steps = h.build()
    h.core.worker_lost(b"w1", "the worker stopped answering")
    (failed,) = h.failures("run")
    assert failed.code == SERVICE_UNAVAILABLE and failed.recoverable and "retry" in failed.message
    assert h.core.requests["wait"].state is State.QUEUED  # it waits for another worker
    assert h.build() == [] and steps  # nothing is sent to a worker that is gone


def test_events_before_the_failure_reach_the_gateway_first():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10)
    h.apply(h.build(), {"r": HE})
    h.core.emit_deferred()
    h.core.worker_lost(b"w1", "gone")
    kinds = [type(m).__name__ for _, m in h.take()]
    assert kinds == ["Events", "RequestFailed"]


def test_a_lost_worker_takes_its_parked_sessions_and_frees_with_it():
    h = Harness()
    h.worker(b"w1")
    h.submit("t", prompt(3), 1, session=wire.SessionRef(key="s"))
    h.run({"t": [HE]})
    h.submit("x", prompt(3), 5)
    h.core.admit()
    h.core.control(b"gw", wire.Cancel(rid="x"))  # a free owed to w1
    h.core.worker_lost(b"w1", "gone")
    assert not h.core.sessions.parked and not h.core.to_free


def test_the_requests_of_other_workers_go_on():
    h = Harness()
    h.worker(b"w1")
    h.worker(b"w2")
    h.submit("a", prompt(3), 10)
    h.submit("b", prompt(3), 10)
    h.cycle()
    lost = h.core.requests["a"].worker
    h.core.worker_lost(lost, "gone")
    assert h.failures("a") and not h.failures("b")
    steps = h.build()
    assert [d.worker for d in steps] == [h.core.requests["b"].worker]


def test_a_returning_worker_starts_clean_and_takes_waiting_requests():
    h = Harness()
    h.worker()
    h.submit("a", prompt(3), 10)
    h.cycle()
    h.core.worker_lost(b"w1", "gone")
    h.submit("b", prompt(3), 10)
    assert h.build() == []
    h.worker()
    (step,) = h.build()
    assert step.step.free_all and h.core.requests["b"].worker == b"w1"


def test_a_worker_that_restarted_under_the_same_identity_lost_its_requests():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10)
    h.cycle()
    h.core.worker_hello(b"w1", wire.WorkerHello(worker_id="w1", stage="loading", incarnation="second-life",
                                                wire_version=wire.WIRE_VERSION))
    (failed,) = h.failures("r")
    assert failed.code == SERVICE_UNAVAILABLE and "restarted" in failed.message
    assert h.core.pool.workers[b"w1"].fresh  # its first step will drop whatever it holds


def test_a_worker_result_reports_its_free_kv():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10)
    h.cycle(kv_free_tokens=1234)
    assert h.core.facts().kv_free_tokens == 1234


def test_hello_progress_changes_are_reported_once():
    h = Harness()
    hello = wire.WorkerHello(worker_id="w", stage="loading", progress=10, wire_version=wire.WIRE_VERSION)
    assert h.core.worker_hello(b"w", hello)
    assert not h.core.worker_hello(b"w", hello)
    assert h.core.worker_hello(b"w", wire.WorkerHello(worker_id="w", stage="loading", progress=50,
                                                      wire_version=wire.WIRE_VERSION))


def test_health_figures_count_queued_running_paused_and_reserved_kv():
    h = Harness(max_batch_size=1)
    h.worker(capacity=100)
    h.submit("a", prompt(3), 7)
    h.submit("b", prompt(3), 7)
    h.cycle({"a": LLO})
    h.core.control(b"gw", wire.Pause(rid="a"))
    facts = h.core.facts()
    assert (facts.queued, facts.running, facts.paused) == (1, 1, 1)
    assert (facts.kv_capacity_tokens, facts.kv_reserved_tokens) == (100, 16)  # 10 tokens, in whole blocks
    assert facts.worker.stage == "ready" and facts.max_model_len == 2048 and facts.eos_token_ids == [2]


def test_facts_before_any_worker_carry_the_configured_context():
    h = Harness(max_model_len=512)
    facts = h.core.facts()
    assert facts.worker == wire.WorkerStage() and facts.max_model_len == 512 and facts.vocab_size == 0


def test_a_worker_of_another_wire_version_is_never_used_and_says_why():
    """A worker running other code (an old host joining) would misread our steps: it counts as failed, health
    and refusals name the mismatch, and a worker of this version is used."""
    h = Harness()
    h.core.worker_hello(b"old", wire.WorkerHello(worker_id="old", stage="ready", vocab_size=64, max_model_len=2048,
                                                 kv_capacity_tokens=4096, wire_version=wire.WIRE_VERSION - 1))
    refused = h.submit("r", prompt(3), 4)
    mismatch = f"speaks wire version {wire.WIRE_VERSION - 1}, this scheduler {wire.WIRE_VERSION}"
    assert isinstance(refused, wire.Error) and mismatch in refused.message
    assert h.core.facts().worker.stage == "failed" and mismatch in h.core.facts().worker.message
    assert h.core.requests == {} and h.build() == []
    h.worker(b"new")
    assert isinstance(h.submit("r", prompt(3), 4), wire.Queued)
    (step,) = h.build()
    assert step.worker == b"new"
    assert [w.identity for w in h.core.pool.ready()] == [b"new"]  # the old one stays unused


def _ready(worker_id: str, **facts: object) -> wire.WorkerHello:
    hello = dict(model="m", vocab_size=64, max_model_len=2048, eos_token_ids=[2], kv_capacity_tokens=4096) | facts
    return wire.WorkerHello(worker_id=worker_id, stage="ready", wire_version=wire.WIRE_VERSION, **hello)


@pytest.mark.parametrize("facts, expected", [
    ({"vocab_size": 100}, "serves 'm' (vocab_size 100, max_model_len 2048, eos_token_ids [2]), the ready worker "
                          "'w1' 'm' (vocab_size 64, max_model_len 2048, eos_token_ids [2]): a scheduler's workers "
                          "serve one model"),
    ({"model": "other"}, "serves 'other' (vocab_size 64"),
    ({"max_model_len": 128}, "max_model_len 128"),
    ({"eos_token_ids": [0]}, "eos_token_ids [0]"),
])
def test_a_worker_serving_another_model_is_never_used_and_says_why(facts, expected):
    """Requests are admitted against the first ready worker's model (its vocabulary, context, EOS): one placed on
    a worker of another would be misread there. It counts as failed; the first one goes on serving."""
    h = Harness()
    h.core.worker_hello(b"w1", _ready("w1"))
    h.core.worker_hello(b"odd", _ready("odd", **facts))
    odd = h.core.pool.workers[b"odd"]
    assert odd.hello.stage == "failed" and expected in odd.hello.message
    for i in range(3):
        h.submit(f"r{i}", prompt(3), 4)
    assert {d.worker for d in h.build()} == {b"w1"}
    assert h.core.facts().vocab_size == 64


@pytest.mark.parametrize("facts", [{"vocab_size": 0}, {"max_model_len": -1}, {"kv_capacity_tokens": 0}])
def test_a_ready_worker_without_model_facts_is_never_used(facts):
    """Admission reads the first ready worker's facts: one that announced none would refuse every prompt."""
    h = Harness()
    h.core.worker_hello(b"empty", _ready("empty", **facts))
    assert h.core.facts().worker.stage == "failed" and "each must be > 0" in h.core.facts().worker.message
    refused = h.submit("r", prompt(3), 4)
    assert isinstance(refused, wire.Error) and "each must be > 0" in refused.message
    h.worker(b"w1")
    assert isinstance(h.submit("r", prompt(3), 4), wire.Queued)
    (step,) = h.build()
    assert step.worker == b"w1"
