"""One request alone and beside one busy process, per worker CPU-thread configuration, in one run.

    .venv/bin/python deploy/loadtest/threads_bench.py [--new-tokens 64] [--repeats 3]
        [--configs default 2:spin 1:passive ...]

Each configuration runs in a fresh process (OpenMP reads its settings when torch loads), set up
the way the worker sets itself up (:func:`services.worker.threads.apply_cpu_threads`), and times
one greedy request through the worker engine (prompt + ``--new-tokens`` tokens) alone, then beside
a process running ``while True: pass``, alternately ``--repeats`` times (best of each). A
configuration is ``default`` (the worker's settings as they are) or ``<threads>:<spin|passive>``;
``<cores>:spin`` is torch's own default before the setting existed. Prints each time, the
busy/alone ratio (target <= 2) and each configuration's alone time against the first one's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(new_tokens: int, repeats: int) -> None:
    """Runs in the configured process: prints one JSON line of timings."""
    from common.config import get_settings
    from services.worker.threads import apply_cpu_threads

    settings = get_settings()
    threads = apply_cpu_threads(settings)
    sys.path.insert(0, str(Path(__file__).parent))
    from worker_bench import bench_engine, load  # noqa: E402 - after the thread setup, as in the worker

    from services.worker.engine import Engine
    from services.worker.kv_cache import BLOCK_SIZE

    loaded, prompt = load(settings.model, settings)
    engine = Engine(loaded, num_blocks=-(-(len(prompt) + new_tokens) // BLOCK_SIZE) + 2)
    bench_engine(engine, prompt, 1, new_tokens, run=0)  # warm-up
    alone, busy = [], []
    for r in range(repeats):
        started = time.perf_counter()
        bench_engine(engine, prompt, 1, new_tokens, run=2 * r + 1)
        alone.append(time.perf_counter() - started)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.2)  # let it take its core
            started = time.perf_counter()
            bench_engine(engine, prompt, 1, new_tokens, run=2 * r + 2)
            busy.append(time.perf_counter() - started)
        finally:
            spinner.kill()
            spinner.wait()
    print(json.dumps({"threads": threads, "wait": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
                      "alone": min(alone), "busy": min(busy)}))


def run_config(config: str, new_tokens: int, repeats: int) -> dict[str, float | int | str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("TILLER_WORKER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if config == "default":
        env.update({k: v for k, v in os.environ.items() if k == "OMP_NUM_THREADS"})
    else:
        threads, wait = config.split(":")
        if wait not in ("spin", "passive"):
            raise SystemExit(f"unknown wait {wait!r} in {config!r}: spin or passive")
        # spin: OpenMP's default (spin, then sleep), torch's behaviour unconfigured
        env.update(TILLER_WORKER_THREADS=threads, TILLER_WORKER_WAIT_POLICY="PASSIVE" if wait == "passive" else "")
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--new-tokens", str(new_tokens), "--repeats", str(repeats)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )
    return {"config": config, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="best of N, alone and busy alternating")
    parser.add_argument("--configs", nargs="+", default=["default", f"{len(os.sched_getaffinity(0))}:spin"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.new_tokens, args.repeats)
        return
    print(f"cores={len(os.sched_getaffinity(0))} load average={os.getloadavg()} new tokens={args.new_tokens} "
          f"repeats={args.repeats} (best of)")
    print(f"{'config':<12}{'threads':>8}{'wait':>10}{'alone s':>9}{'busy s':>9}{'busy/alone':>11}{'alone vs first':>16}")
    first = None
    for config in args.configs:
        row = run_config(config, args.new_tokens, args.repeats)
        first = first or row["alone"]
        print(f"{config:<12}{row['threads']:>8}{row['wait']:>10}{row['alone']:>9.2f}{row['busy']:>9.2f}"
              f"{row['busy'] / row['alone']:>10.1f}x{row['alone'] / first:>15.2f}x")


if __name__ == "__main__":
    main()
