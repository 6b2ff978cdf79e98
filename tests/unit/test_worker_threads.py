"""The worker's CPU thread plan (services/worker/threads.py): the count and wait policy torch starts with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import Settings
from services.worker.threads import apply_cpu_threads, plan_threads

ROOT = Path(__file__).resolve().parents[2]


def test_the_setting_wins_then_omp_num_threads_then_the_cores_left() -> None:
    assert plan_threads(3, 0, cores=8, environ={"OMP_NUM_THREADS": "1"}) == 3
    assert plan_threads(None, 0, cores=8, environ={"OMP_NUM_THREADS": "2"}) == 2
    assert plan_threads(None, 0, cores=8, environ={"OMP_NUM_THREADS": ""}) == 8
    assert plan_threads(None, 1.5, cores=8, environ={}) == 6
    assert plan_threads(None, 4, cores=2, environ={}) == 1  # never none


def test_torch_in_the_worker_starts_with_the_planned_threads_and_passive_waiting() -> None:
    script = (
        "from common.config import Settings\n"
        "from services.worker.threads import apply_cpu_threads\n"
        "n = apply_cpu_threads(Settings())\n"
        "import os, torch\n"
        "print(n, torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TILLER_", "OMP_"))}
    env.update(PYTHONPATH=str(ROOT), TILLER_WORKER_THREADS="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "PASSIVE"]


def test_applying_after_torch_loaded_is_refused() -> None:
    import torch  # noqa: F401 - loaded in this process, as a late call would find it

    environ: dict[str, str] = {}
    with pytest.raises(RuntimeError, match="before torch is imported"):
        apply_cpu_threads(Settings(), environ)
    assert environ == {}
