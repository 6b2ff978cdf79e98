"""Start-up time and memory of the stack, as ``make up`` starts it.

Each run starts the stack with ``tiller up`` (what ``make up`` runs) in a fresh run directory on free
ports, with the model already converted in the cache (a warm start), and sends one streaming OpenAI
completion the moment ``up`` returns. It prints the seconds from launch to ``up`` returning and to the
first served token, the worker's model load (``load_s`` of its ``worker.ready`` log line: weights from
the converted cache, the engine built), and each process's RSS and PSS after the request; then judges the targets: every process but the worker at most 150 MB
RSS, first token within 10 s of launch, the worker's load within 3 s. The caller's TILLER_* settings
reach the stack.

    python deploy/loadtest/startup_report.py [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serving import Memory, memory, openai_stream  # noqa: E402

from common.cli import SERVICES  # noqa: E402
from tests.stack import Stack, start_stack  # noqa: E402

PROCESS_LIMIT_MB = 150
FIRST_TOKEN_LIMIT_S = 10.0
WORKER_LOAD_LIMIT_S = 3.0


@dataclass
class Startup:
    up_s: float  # launch to `tiller up` returning (every service ready)
    first_token_s: float  # launch to the first streamed token of the first request
    worker_load_s: float
    memory: dict[str, Memory]


def worker_load_s(stack: Stack) -> float:
    """``load_s`` of the worker's ``worker.ready`` log line."""
    for line in (stack.run_dir / "logs" / "worker.log").read_text(errors="replace").splitlines():
        if '"worker.ready"' in line:
            return float(json.loads(line)["load_s"])
    raise RuntimeError("the worker's log has no worker.ready line")


def start_once() -> Startup:
    configured = {k: v for k, v in os.environ.items() if k.startswith("TILLER_")}
    launched = time.perf_counter()
    stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-startup-")), **configured)
    try:
        up_s = time.perf_counter() - launched
        client = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        first = asyncio.run(openai_stream(client, stack.settings.served_model_name, "The capital of France is", 8))
        first_token_s = up_s + first.ttft_s
        return Startup(up_s, first_token_s, worker_load_s(stack), {n: memory(stack.pid(n)) for n in SERVICES})
    finally:
        stack.down()


def report(run: int, s: Startup) -> list[str]:
    """Prints one run; returns the targets it misses."""
    print(f"run {run}: `tiller up` returned after {s.up_s:.1f} s; first token {s.first_token_s:.1f} s after launch; "
          f"worker load {s.worker_load_s:.2f} s")
    print(f"  {'process':20s} {'RSS MB':>8s} {'PSS MB':>8s}")
    for name, mem in s.memory.items():
        print(f"  {name:20s} {mem.rss_mb:8.0f} {mem.pss_mb:8.0f}")
    total = sum(s.memory.values(), Memory(0, 0))
    print(f"  {'all five':20s} {total.rss_mb:8.0f} {total.pss_mb:8.0f}")
    missed = [f"{name} {mem.rss_mb:.0f} MB RSS > {PROCESS_LIMIT_MB}" for name, mem in s.memory.items()
              if name != "worker" and mem.rss_mb > PROCESS_LIMIT_MB]
    if s.first_token_s > FIRST_TOKEN_LIMIT_S:
        missed.append(f"first token {s.first_token_s:.1f} s > {FIRST_TOKEN_LIMIT_S:.0f}")
    if s.worker_load_s > WORKER_LOAD_LIMIT_S:
        missed.append(f"worker load {s.worker_load_s:.2f} s > {WORKER_LOAD_LIMIT_S:.0f}")
    return missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="start the stack this many times, one after another")
    args = parser.parse_args()
    missed = []
    for run in range(1, args.runs + 1):
        missed += [f"run {run}: {m}" for m in report(run, start_once())]
    print("targets (non-worker RSS <= 150 MB, first token <= 10 s, worker load <= 3 s): "
          + ("all met" if not missed else "missed: " + "; ".join(missed)))


if __name__ == "__main__":
    main()
