"""Start-up time and memory of the stack, as ``make up`` starts it.

Each run starts the stack with ``tiller up`` (what ``make up`` runs) in a fresh run directory on free
ports, with the model already converted in the cache (a warm start), and sends one streaming OpenAI
completion the moment ``up`` returns. It prints the seconds from launch to ``up`` returning and to the
first served token, the worker's model load (``load_s`` of its ``worker.ready`` log line: weights from
the converted cache, the engine built), each process's RSS and PSS after the request, and the CPU
seconds each took from launch to the first token (with ``tiller up``'s own readiness polling): on a
shared machine the wall-clock figures stretch with the load, the CPU seconds much less. Then it judges
the targets: every process but the worker at most 150 MB RSS, first token within 10 s of launch, the
worker's load within 3 s. The stack serves what ``make up`` serves (the default weights, not the tests'
fp32); the caller's TILLER_* settings reach it.

    python deploy/loadtest/startup_report.py [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serving import Memory, memory, openai_stream, process_cpu_s  # noqa: E402

from common.supervisor import SERVICES  # noqa: E402
from tests.stack import Stack, served_settings, start_stack  # noqa: E402

PROCESS_LIMIT_MB = 150
FIRST_TOKEN_LIMIT_S = 10.0
WORKER_LOAD_LIMIT_S = 3.0


@dataclass
class Startup:
    up_s: float  # launch to `tiller up` returning (every service ready)
    first_token_s: float  # launch to the first streamed token of the first request
    worker_load_s: float
    packed: bool  # the worker packed the GGUF's layers this start (none kept from an earlier one)
    memory: dict[str, Memory]
    cpu_s: dict[str, float]  # launch to first token, by process ("tiller up": it and its supervisorctl calls)


def worker_load(stack: Stack) -> tuple[float, bool]:
    """``load_s`` of the worker's ``worker.ready`` log line, and whether it wrote packed layers."""
    log = (stack.run_dir / "logs" / "worker.log").read_text(errors="replace")
    for line in log.splitlines():
        if '"worker.ready"' in line:
            return float(json.loads(line)["load_s"]), '"worker.packed_cache_written"' in log
    raise RuntimeError("the worker's log has no worker.ready line")


def start_once() -> Startup:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    launched = time.perf_counter()
    stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-startup-")), **served_settings())
    try:
        up_s = time.perf_counter() - launched
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        client = openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
        first = asyncio.run(openai_stream(client, stack.settings.served_model_name, "The capital of France is", 8))
        pids = {name: stack.pid(name) for name in SERVICES}
        cpu = {name: process_cpu_s(pid) for name, pid in pids.items()}
        cpu["tiller up"] = waited.ru_utime + waited.ru_stime - children.ru_utime - children.ru_stime
        return Startup(up_s, up_s + first.ttft_s, *worker_load(stack), {n: memory(p) for n, p in pids.items()}, cpu)
    finally:
        stack.down()


def report(run: int, s: Startup) -> list[str]:
    """Prints one run; returns the targets it misses."""
    packed = " (packing the GGUF's layers, kept for later starts)" if s.packed else ""
    print(f"run {run}: `tiller up` returned after {s.up_s:.1f} s; first token {s.first_token_s:.1f} s after launch; "
          f"worker load {s.worker_load_s:.2f} s{packed}")
    print(f"  {'process':20s} {'RSS MB':>8s} {'PSS MB':>8s} {'CPU s':>7s}")
    for name, mem in s.memory.items():
        print(f"  {name:20s} {mem.rss_mb:8.0f} {mem.pss_mb:8.0f} {s.cpu_s[name]:7.2f}")
    print(f"  {'tiller up':20s} {'':8s} {'':8s} {s.cpu_s['tiller up']:7.2f}")
    total = sum(s.memory.values(), Memory(0, 0))
    print(f"  {'all':20s} {total.rss_mb:8.0f} {total.pss_mb:8.0f} {sum(s.cpu_s.values()):7.2f}")
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
