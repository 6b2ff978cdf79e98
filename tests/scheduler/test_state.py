"""The core's index of the workers with work (``CoreState.busy_workers``), which steps are built from: a worker
is in it from the admission of its first sequence until its last one ended and its frees went out."""

from common import wire
from tests.scheduler.harness import HE, Harness, prompt


def test_a_worker_has_work_from_admission_until_its_frees_went_out():
    h = Harness()
    h.worker(b"w1")
    h.worker(b"w2")
    assert h.core.busy_workers() == set()
    h.submit("r", prompt(3), 1)
    assert h.core.busy_workers() == set()  # queued: on no worker yet
    h.core.admit()
    worker = h.core.requests["r"].worker
    assert h.core.busy_workers() == {worker}
    h.apply(h.build())  # its one token ends it: its sequence is freed with the next step
    assert h.core.busy_workers() == {worker} and h.core.to_free[worker]
    (free,) = h.build()
    assert free.worker == worker and free.step.free and not free.step.seqs
    assert h.core.busy_workers() == set() and not h.core.state.running_on


def test_a_paused_request_keeps_its_worker_in_the_index_and_a_lost_worker_leaves_it():
    h = Harness()
    h.worker(b"w1")
    h.submit("r", prompt(3), 8)
    h.cycle()
    h.core.control(b"gw", wire.Pause(rid="r"))
    assert h.build() == [] and h.core.busy_workers() == {b"w1"}  # nothing to step, but its sequence is there
    h.core.worker_lost(b"w1", "gone")
    assert h.core.busy_workers() == set() and not h.core.state.batches


def test_a_parked_session_turn_leaves_its_worker_idle():
    h = Harness()
    h.worker(b"w1")
    h.submit("t", prompt(3), 1, session=wire.SessionRef(key="s"))
    h.run({"t": [HE]})
    assert h.core.sessions.parked and h.core.busy_workers() == set()  # parked KV needs no step
