"""One request alone and beside one busy process, per worker CPU-thread configuration, in one run.

    .venv/bin/python deploy/loadtest/threads_bench.py [--new-tokens 64] [--repeats 3]
        [--configs default 2:spin 2:spin=2000 1:passive ...]

Each configuration runs in a process of its own (OpenMP reads its settings when torch loads), set
up the way the worker sets itself up (:func:`services.worker.threads.apply_cpu_threads`), which
loads the model once and then times one greedy request through the worker engine (prompt +
``--new-tokens`` tokens) whenever asked. The configurations take turns, ``--repeats`` rounds: in
each round every one runs the request alone, then beside a process running ``while True: pass``;
the best of each is printed, so that load from elsewhere touches every configuration alike. A
configuration is ``default`` (the worker's settings as they are) or
``<threads>:<spin|passive>[=<n>][+governor]`` (``spin``: OpenMP's own default, spinning a while
before sleeping; ``passive``: sleeping at once; ``=<n>``: spinning ``n`` rounds before sleeping,
``GOMP_SPINCOUNT``; ``+governor``: with the worker's thread governor, which runs fewer threads while
other processes take the cores); ``<cores>:spin`` is torch's own default. Prints each time, the busy/alone ratio (target <= 2) and each configuration's alone time
against the first one's (target <= 1.1 against torch's default).
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


def child(new_tokens: int) -> None:
    """Runs in the configured process: one JSON line when loaded, then one timing per input line.
    Those lines alone go to the parent: anything else written to stdout (logs) goes to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from common.config import get_settings
    from services.worker.threads import apply_cpu_threads, thread_governor

    settings = get_settings()
    threads = apply_cpu_threads(settings)
    sys.path.insert(0, str(Path(__file__).parent))
    from worker_bench import bench_engine, load  # noqa: E402 - after the thread setup, as in the worker

    from services.worker.engine import Engine
    from services.worker.kv_cache import BLOCK_SIZE

    loaded, prompt = load(settings.model, settings)
    engine = Engine(loaded, num_blocks=-(-(len(prompt) + new_tokens) // BLOCK_SIZE) + 2)
    govern_threads, step = thread_governor(settings, threads), engine.step

    def governed_step(*args, **kwargs):  # as the worker's step loop runs it
        govern_threads()
        return step(*args, **kwargs)

    engine.step = governed_step  # type: ignore[method-assign]
    bench_engine(engine, prompt, 1, new_tokens, run=0)  # warm-up
    wait = os.environ.get("OMP_WAIT_POLICY", "spin")
    if "GOMP_SPINCOUNT" in os.environ:
        wait += f"={os.environ['GOMP_SPINCOUNT']}"
    print(json.dumps({"threads": threads, "wait": wait}), file=answers, flush=True)
    for run, _ in enumerate(sys.stdin, start=1):
        started = time.perf_counter()
        bench_engine(engine, prompt, 1, new_tokens, run=run)
        print(time.perf_counter() - started, file=answers, flush=True)


class Config:
    """One configuration's process, loaded and waiting for requests to time."""

    def __init__(self, config: str, new_tokens: int) -> None:
        self.config = config
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("TILLER_WORKER_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        if config == "default":
            env.update({k: v for k, v in os.environ.items() if k == "OMP_NUM_THREADS"})
        else:
            threads, _, wait = config.partition(":")
            wait, governed, _ = wait.partition("+governor")
            wait, _, spins = wait.partition("=")
            if wait not in ("spin", "passive") or not threads.isdigit() or not (spins.isdigit() or not spins):
                raise SystemExit(f"bad config {config!r}: <threads>:<spin|passive>[=<spin count>][+governor]")
            env.update(TILLER_WORKER_THREADS=threads, TILLER_WORKER_WAIT_POLICY="PASSIVE" if wait == "passive" else "")
            if not governed:
                env["TILLER_WORKER_THREADS_INTERVAL_S"] = "0"
            if spins:
                env["TILLER_WORKER_SPIN_COUNT"] = spins
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", "--new-tokens", str(new_tokens)],
            env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        described = json.loads(self.proc.stdout.readline())
        self.threads, self.wait = described["threads"], described["wait"]
        self.alone: list[float] = []
        self.busy: list[float] = []

    def time_one(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; best of each")
    parser.add_argument("--configs", nargs="+", default=["default", f"{len(os.sched_getaffinity(0))}:spin"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.new_tokens)
        return
    print(f"cores={len(os.sched_getaffinity(0))} load average={os.getloadavg()} new tokens={args.new_tokens} "
          f"rounds={args.repeats} (best of)", flush=True)
    configs = [Config(c, args.new_tokens) for c in args.configs]
    try:
        for _ in range(args.repeats):
            for c in configs:
                c.alone.append(c.time_one())
                spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                try:
                    time.sleep(0.2)  # let it take its core
                    c.busy.append(c.time_one())
                finally:
                    spinner.kill()
                    spinner.wait()
                print(f"  {c.config}: alone {c.alone[-1]:.2f} s, busy {c.busy[-1]:.2f} s", flush=True)
    finally:
        for c in configs:
            c.close()
    print(f"load average after={os.getloadavg()}")
    print(f"{'config':<16}{'threads':>8}{'wait':>14}{'alone s':>9}{'busy s':>9}{'busy/alone':>11}{'alone vs first':>16}")
    first = min(configs[0].alone)
    for c in configs:
        alone, busy = min(c.alone), min(c.busy)
        print(f"{c.config:<16}{c.threads:>8}{c.wait:>14}{alone:>9.2f}{busy:>9.2f}"
              f"{busy / alone:>10.1f}x{alone / first:>15.2f}x")


if __name__ == "__main__":
    main()
