"""One gateway process vs several on the same port (``tiller up --gateways N``), in one run: N concurrent
WebSocket streams against a stack started with each gateway count in turn (alternating over ``--rounds``, so
a machine that slows down mid-run weighs on every count alike), with tokens/s, TTFT and inter-token latency
p50/p99, and the CPU time the gateway processes together spent per token.

    python deploy/loadtest/gateways_bench.py [--streams 64] [--tokens 128] [--gateways 1 2] [--rounds 2] [--cpu-proxy]

Each stream opens its own connection, so the kernel spreads them over the gateway processes. Several gateways
gain only where one gateway's event loop is what limits (many streams, a short step: ``--cpu-proxy``, or a
GPU) and there are cores to run them on: on a machine with few cores they compete with the scheduler and the
worker instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.config import get_settings  # noqa: E402
from common.supervisor import program_status, service_of  # noqa: E402
from bench_stack import CpuPerToken, cpu_proxy_model, one_stream, percentile, streams  # noqa: E402


@dataclass
class Round:
    gateways: int
    tok_s: float
    ttft_ms: tuple[float, float]  # p50, p99
    itl_ms: tuple[float, float]
    gateway_cpu_us: float  # per token, every gateway process together


def measure(gateways: int, n_streams: int, tokens: int) -> Round:
    """One stack with ``gateways`` gateway processes: a warm-up stream, then ``n_streams`` at once."""
    from tests.stack import served_settings, start_stack

    stack = start_stack(Path(tempfile.mkdtemp(prefix="tiller-gateways-bench-")),
                        **{**served_settings(), "TILLER_DISTRIBUTED__GATEWAYS": str(gateways)})
    try:
        pids = {name: pid for name, (_, pid, _) in program_status(stack.settings).items()
                if service_of(name) == "gateway" and pid is not None}
        cpu = CpuPerToken(pids)
        asyncio.run(one_stream(stack.ws_url, tokens))
        cpu.start()
        tok_s, results = asyncio.run(streams(stack.ws_url, n_streams, tokens))
        per_token = cpu.stop(sum(r.tokens for r in results))
    finally:
        stack.down()
    ttft = [r.ttft_s * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r.gaps_s]
    return Round(gateways, tok_s, (percentile(ttft, 0.5), percentile(ttft, 0.99)),
                 (percentile(gaps, 0.5), percentile(gaps, 0.99)), sum(per_token.values()) * 1e6)


def describe(r: Round) -> str:
    return (f"{r.gateways} gateway(s): {r.tok_s:8.1f} tok/s  TTFT p50 {r.ttft_ms[0]:7.1f} ms p99 {r.ttft_ms[1]:7.1f} "
            f"ms  ITL p50 {r.itl_ms[0]:6.1f} ms p99 {r.itl_ms[1]:6.1f} ms  gateway CPU {r.gateway_cpu_us:5.0f} us/token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2], help="gateway counts to compare")
    parser.add_argument("--rounds", type=int, default=2, help="stacks started per gateway count, alternating")
    parser.add_argument("--cpu-proxy", action="store_true", help="bench_stack.py's tiny model: a GPU-short step")
    args = parser.parse_args()
    if args.cpu_proxy:  # before torch is imported in the stack's processes
        os.environ.update(OMP_NUM_THREADS="1", TILLER_DEVICE="cpu", TILLER_MODEL=cpu_proxy_model())
        get_settings.cache_clear()
    settings = get_settings()
    print(f"model {settings.model} on {settings.device}, {args.streams} streams x {args.tokens} greedy tokens, "
          f"{os.cpu_count()} cores", flush=True)
    rounds: dict[int, list[Round]] = {count: [] for count in args.gateways}
    for _ in range(args.rounds):
        for count in args.gateways:
            rounds[count].append(measure(count, args.streams, args.tokens))
            print("  " + describe(rounds[count][-1]), flush=True)
    base = statistics.median(r.tok_s for r in rounds[args.gateways[0]])
    for count, measured in rounds.items():
        median = statistics.median(r.tok_s for r in measured)
        print(f"{count} gateway(s): median {median:8.1f} tok/s ({median / base:4.2f}x {args.gateways[0]})")


if __name__ == "__main__":
    main()
