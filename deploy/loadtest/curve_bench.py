"""What CurveZMQ costs the whole stack: ``bench_stack.py`` with every ZeroMQ endpoint on ``tcp://127.0.0.1``,
without keys and with them (``curve.secret_key``: every socket encrypted and authenticated), alternated
round by round (the order swapping each round) so that a shared machine's load falls on both alike.
Prints every round's tokens/s and each service's CPU µs per token at one stream and at ``--streams``,
then the medians, their ratio curve / plain and the median of the rounds' own ratios.

    python deploy/loadtest/curve_bench.py [--rounds 2] [--tokens 128] [--streams 16] [--no-cpu-proxy]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "deploy" / "loadtest"))

from ab_stack import add_round_arguments, print_round, report, run_once  # noqa: E402
from common.curve import make_key_pair  # noqa: E402
from tests.stack import free_port  # noqa: E402

ENDPOINTS = ("SCHEDULER", "WORKER", "CONTROLLER_MAIN", "CONTROLLER_SIDE", "SESSION_STORE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_round_arguments(parser, rounds=2, tokens=128, streams=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tiller-curve-bench-"))
    _, secret = make_key_pair(work / "keys", "bench")
    tcp = {f"TILLER_{name}_ENDPOINT": f"tcp://127.0.0.1:{free_port()}" for name in ENDPOINTS}
    configs = {"plain": tcp, "curve": {**tcp, "TILLER_CURVE__SECRET_KEY": str(secret)}}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for round_no in range(args.rounds):
        order = list(configs) if round_no % 2 == 0 else list(reversed(configs))
        for name in order:
            figures = run_once(ROOT, args, work / f"{round_no}-{name}.json", configs[name])
            runs[name].append(figures)
            print_round(round_no, name, figures)
    report(runs, "curve", "plain", args.streams)


if __name__ == "__main__":
    main()
