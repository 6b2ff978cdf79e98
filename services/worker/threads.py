"""How many CPU threads the worker's torch runs, and how they wait; decided before torch starts.

torch's CPU kernels run on an OpenMP pool. By default its threads spin while waiting for each
other; when another process holds one of the cores, the thread that cannot run holds up every
spinning one, and a request took 50x longer beside a single busy process. Passive waiting
(``OMP_WAIT_POLICY=PASSIVE``: a waiting thread sleeps) costs little alone and keeps the slowdown in
proportion to the cores taken. OpenMP reads these variables once, when torch loads it, so
:func:`apply_cpu_threads` must run before the first ``import torch`` in the worker process.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import MutableMapping

from common.config import Settings

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
    return threads
