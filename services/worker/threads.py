"""How many CPU threads the worker's torch runs, and how they wait; decided before torch starts,
then adjusted between steps to what the rest of the machine leaves free.

torch's CPU kernels run on an OpenMP pool. Its threads spin while waiting for each other (OpenMP's
default: a few milliseconds, then sleep), and that is what makes two threads fast on an otherwise
idle machine: a thread that sleeps between two kernels pays a wake-up (tens of microseconds on a
virtual machine) at the next one, hundreds of times a step, and two sleeping threads decoded
slower than one. But when another process holds one of the cores, the thread that cannot run
holds up the spinning one at every kernel, and a request took 50x longer beside a single busy
process. So the pool spins, and the :class:`ThreadGovernor` watches the CPU time the other
processes on the worker's cores take and lowers the thread count while they would take a core
from it (and raises it again once they stop): one thread never waits for another.

OpenMP reads its variables once, when torch loads it, so :func:`apply_cpu_threads` must run before
the first ``import torch`` in the worker process; the governor's count goes to
``torch.set_num_threads`` on the thread that runs the steps.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import structlog

from common.config import Settings

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers' cpusets narrow)."""
    return len(os.sched_getaffinity(0))


def plan_threads(setting: int | None, reserved_cores: float, cores: int, environ: MutableMapping[str, str]) -> int:
    """The worker's thread count: the setting, else an explicit ``OMP_NUM_THREADS``, else the cores
    left after ``reserved_cores`` (at least one)."""
    if setting is not None:
        return setting
    explicit = environ.get("OMP_NUM_THREADS", "")
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    return max(1, math.floor(cores - reserved_cores))


def apply_cpu_threads(settings: Settings, environ: MutableMapping[str, str] = os.environ) -> int:
    """Fix the worker's OpenMP threads and wait policy and return the thread count. Call it before
    torch is imported."""
    if "torch" in sys.modules:
        raise RuntimeError("apply_cpu_threads must run before torch is imported: OpenMP reads its settings once")
    threads = plan_threads(settings.worker_threads, settings.worker_reserved_cores, usable_cores(), environ)
    environ["OMP_NUM_THREADS"] = str(threads)
    if settings.worker_wait_policy:
        environ["OMP_WAIT_POLICY"] = settings.worker_wait_policy
    if settings.worker_spin_count is not None:
        environ["GOMP_SPINCOUNT"] = str(settings.worker_spin_count)
    return threads


RESUME_WINDOW_S = 0.05
"""The first window after the worker sat idle: five of /proc/stat's 10 ms ticks per core, so the
thread count a busy spell left (or an idle one) is corrected within a few steps of new work."""


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds used so far on the worker's cores by everything (``busy_s``) and by the worker
    process itself (``own_s``), at monotonic time ``at_s``."""

    at_s: float
    busy_s: float
    own_s: float


class ThreadGovernor:
    """The worker's thread count from successive :class:`CpuSample`: the cores the other processes
    leave free since the last sample (``cores`` minus their CPU seconds per second). It drops a
    thread when the free cores fall half a core below the threads, and adds one back when they
    reach three quarters of a core above them, between 1 and ``max_threads``."""

    def __init__(self, max_threads: int, cores: int) -> None:
        self.max_threads = max_threads
        self.cores = cores
        self.threads = max_threads
        self._last: CpuSample | None = None

    def restart(self, sample: CpuSample) -> None:
        """Start a new window at ``sample`` without deciding (after the worker sat idle, what the
        others did meanwhile says little about the work now starting)."""
        self._last = sample

    def observe(self, sample: CpuSample) -> int | None:
        """The new thread count when it should change, else None (also for the first sample)."""
        last, self._last = self._last, sample
        if last is None or sample.at_s <= last.at_s:
            return None
        elapsed = sample.at_s - last.at_s
        others = max(0.0, (sample.busy_s - last.busy_s) - (sample.own_s - last.own_s)) / elapsed
        free = self.cores - others
        threads = self.threads
        while threads > 1 and free < threads - 0.5:
            threads -= 1
        while threads < self.max_threads and free >= threads + 0.75:
            threads += 1
        if threads == self.threads:
            return None
        self.threads = threads
        return threads


def read_cpu_sample(cpus: set[int] | None = None) -> CpuSample:
    """A :class:`CpuSample` of this process on ``cpus`` (default: its affinity), from ``/proc``."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    busy = 0
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            if not name[3:].isdigit():
                break
            if int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
                busy += user + nice + system + irq + softirq + steal
    with open("/proc/self/stat") as own:
        fields = own.read().rsplit(")", 1)[1].split()
    return CpuSample(time.monotonic(), busy / CLOCK_TICKS, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)


def thread_governor(settings: Settings, threads: int) -> Callable[[], None]:
    """What the step loop calls before each step: it samples the CPU every
    ``worker_threads_interval_s`` and sets torch's thread count to the governor's (a no-op when the
    interval is 0, there is one thread, or ``/proc`` cannot be read)."""
    if settings.worker_threads_interval_s <= 0 or threads <= 1:
        return lambda: None
    import torch

    cpus = os.sched_getaffinity(0)
    log = structlog.get_logger()
    try:
        read_cpu_sample(cpus)
    except (OSError, ValueError) as exc:  # no /proc: the thread count stays as it started
        log.warning("worker.threads_not_governed", reason=str(exc))
        return lambda: None
    governor = ThreadGovernor(threads, len(cpus))
    interval_s, next_at = settings.worker_threads_interval_s, 0.0
    settle_s = min(interval_s, RESUME_WINDOW_S)

    def tick() -> None:
        nonlocal next_at
        now = time.monotonic()
        if now < next_at:
            return
        sample = read_cpu_sample(cpus)
        if now - next_at > interval_s:  # no step asked for a whole interval: the worker sat idle
            governor.restart(sample)  # decide from a short window of the work now starting
            next_at = now + settle_s
            return
        next_at = now + interval_s
        changed = governor.observe(sample)
        if changed is not None:
            torch.set_num_threads(changed)
            log.debug("worker.threads", threads=changed)

    return tick
