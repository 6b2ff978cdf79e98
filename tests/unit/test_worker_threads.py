"""The worker's CPU thread plan (services/worker/threads.py): the count and wait policy torch starts with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import Settings
from services.worker.threads import (
    CLOCK_TICKS, CpuSample, ThreadGovernor, apply_cpu_threads, plan_threads, read_cpu_sample,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_setting_wins_then_omp_num_threads_then_the_cores_left() -> None:
    assert plan_threads(3, 0, cores=8, environ={"OMP_NUM_THREADS": "1"}) == 3
    assert plan_threads(None, 0, cores=8, environ={"OMP_NUM_THREADS": "2"}) == 2
    assert plan_threads(None, 0, cores=8, environ={"OMP_NUM_THREADS": ""}) == 8
    assert plan_threads(None, 1.5, cores=8, environ={}) == 6
    assert plan_threads(None, 4, cores=2, environ={}) == 1  # never none


def test_torch_in_the_worker_starts_with_the_planned_threads_and_wait() -> None:
    script = (
        "from common.config import Settings\n"
        "from services.worker.threads import apply_cpu_threads\n"
        "n = apply_cpu_threads(Settings())\n"
        "import os, torch\n"
        "print(n, torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TILLER_", "OMP_", "GOMP_"))}
    env.update(PYTHONPATH=str(ROOT), TILLER_WORKER_THREADS="1", TILLER_WORKER_WAIT_POLICY="PASSIVE",
               TILLER_WORKER_SPIN_COUNT="2000")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "PASSIVE", "2000"]


def _samples(*others_per_s: float, own_per_s: float = 1.5, interval_s: float = 0.25) -> list[CpuSample]:
    """Samples ``interval_s`` apart in which the other processes take ``others_per_s`` cores each."""
    samples, busy, own = [CpuSample(0.0, 0.0, 0.0)], 0.0, 0.0
    for i, others in enumerate(others_per_s, start=1):
        own += own_per_s * interval_s
        busy += (own_per_s + others) * interval_s
        samples.append(CpuSample(i * interval_s, busy, own))
    return samples


def test_the_governor_yields_a_core_to_a_busy_process_and_takes_it_back() -> None:
    governor = ThreadGovernor(max_threads=2, cores=2)
    # alone, then the stack's other services' few percent, then a busy process (beside two spinning
    # threads it gets 2/3 of a core, then a whole one), then it stops
    changes = [governor.observe(s) for s in _samples(0.0, 0.2, 0.67, 1.0, 1.0, 0.3, 0.0)]
    assert changes == [None, None, None, 1, None, None, None, 2]
    assert governor.threads == 2


def test_after_an_idle_spell_the_governor_decides_from_a_fresh_window() -> None:
    governor = ThreadGovernor(max_threads=2, cores=2)
    busy = _samples(0.0, 1.0)  # a busy neighbour took a thread away
    assert [governor.observe(s) for s in busy] == [None, None, 1]
    last = busy[-1]
    # the worker sat idle for 10 s while others took 15 CPU seconds, then work resumes alone
    resumed = CpuSample(last.at_s + 10.0, last.busy_s + 15.0, last.own_s)
    governor.restart(resumed)
    alone = CpuSample(resumed.at_s + 0.05, resumed.busy_s + 0.1, resumed.own_s + 0.1)
    assert governor.observe(alone) == 2  # the idle spell's 1.5 cores of others count for nothing


def test_the_governor_keeps_at_least_one_thread_and_at_most_its_maximum() -> None:
    governor = ThreadGovernor(max_threads=3, cores=4)
    assert [governor.observe(s) for s in _samples(4.0, 4.0, 0.0)] == [None, 1, None, 3]


def test_a_cpu_sample_counts_this_process_in_the_machine() -> None:
    first = read_cpu_sample()
    deadline = first.own_s + 0.3
    while read_cpu_sample().own_s < deadline:  # burn some CPU of our own
        pass
    second = read_cpu_sample()
    assert second.at_s > first.at_s
    own_ticks = round((second.own_s - first.own_s) * CLOCK_TICKS)
    busy_ticks = round((second.busy_s - first.busy_s) * CLOCK_TICKS)
    assert own_ticks >= 0.3 * CLOCK_TICKS
    # our own seconds are among everything's; the machine's counters are sampled at the timer tick while
    # our own are accounted exactly, so over 0.3 s the machine's may trail ours by a few ticks (a CI
    # machine once counted 3 of our 5 over 50 ms)
    assert busy_ticks >= 0.8 * own_ticks


def test_applying_after_torch_loaded_is_refused() -> None:
    import torch  # noqa: F401 - loaded in this process, as a late call would find it

    environ: dict[str, str] = {}
    with pytest.raises(RuntimeError, match="before torch is imported"):
        apply_cpu_threads(Settings(), environ)
    assert environ == {}
