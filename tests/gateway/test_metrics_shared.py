"""/metrics of several gateway processes (prometheus_client's multiprocess mode, as ``tiller up --gateways N``
sets it): any process answers with the sum of all, a killed one's streams no longer count as active."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.stack import ROOT

ONE_GATEWAY = """
from services.gateway.metrics import Metrics
metrics = Metrics()
metrics.requests.labels("rest", "stop").inc()
metrics.active_streams.labels("rest").inc()
"""
RENDER = ONE_GATEWAY + "print(metrics.render().decode())"


def run(code: str, directory: Path) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_any_process_renders_the_sum_and_a_dead_ones_streams_go(tmp_path: Path) -> None:
    run(ONE_GATEWAY, tmp_path)  # a gateway that served one request and died mid-stream
    text = run(RENDER, tmp_path)
    assert 'tiller:requests_total{outcome="stop",surface="rest"} 2.0' in text
    assert 'tiller:active_streams{surface="rest"} 1.0' in text
