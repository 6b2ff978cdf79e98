"""Two trees' whole stacks against each other, in one run: ``bench_stack.py`` served by this checkout and
by another git revision, alternated round by round (the order swapping each round), so that a shared
machine's load falls on both alike.

Each round runs ``bench_stack.py`` (this tree's script, client and in-process baselines) once per tree,
the stack started from that tree's code (``--serve-from``); the other revision is checked out into a
temporary detached worktree, removed at the end. Prints every round's tokens/s and each service's CPU
µs per token at one stream and at each ``--streams`` count, then per tree the medians, their ratio this tree / the
other one, and the median of the rounds' own ratios (tokens/s above 1 and CPU below 1 favour this tree).

    python deploy/loadtest/ab_stack.py --base 40b5b6c [--rounds 4] [--tokens 256] [--streams 8 32] [--no-cpu-proxy]
        [--weights auto fp32]

``--weights`` runs each round once per ``TILLER_WEIGHTS`` setting and reports each apart;
``deploy/loadtest/guard.py`` runs it as the worker's speed guard.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "deploy" / "loadtest" / "bench_stack.py"


def run_once(tree: Path, args: argparse.Namespace, out: Path, env: dict[str, str] | None = None) -> dict:
    """``bench_stack.py`` served from ``tree`` (with ``env``: this environment and more), once per
    ``args.streams`` count: the first run's one-stream figures, and each run's many-stream ones under
    ``many`` by stream count (``{n: {"tok_s", "cpu_s"}}``)."""
    figures: dict = {"many": {}}
    for n in args.streams:
        run = _bench(tree, args, n, out.with_suffix(f".{n}.json"), env)
        figures.setdefault("single_tok_s", run["single_tok_s"])
        figures.setdefault("single_cpu_s", run["single_cpu_s"])
        figures["many"][n] = {"tok_s": run["many_tok_s"], "cpu_s": run["many_cpu_s"]}
    return figures


def _bench(tree: Path, args: argparse.Namespace, streams: int, out: Path, env: dict[str, str] | None) -> dict:
    """One ``bench_stack.py`` run at ``streams`` concurrent streams; its figures."""
    command = [sys.executable, str(BENCH), "--tokens", str(args.tokens), "--streams", str(streams),
               "--serve-from", str(tree), "--json", str(out)]
    if args.cpu_proxy:
        command.append("--cpu-proxy")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env})
    if done.returncode != 0:
        raise SystemExit(f"bench_stack.py failed for {tree}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def cpu_us(per_service: dict[str, float]) -> str:
    return f"{sum(per_service.values()) * 1e6:6.0f} (" + " ".join(
        f"{name[:5]} {seconds * 1e6:.0f}" for name, seconds in per_service.items() if seconds * 1e6 >= 1) + ")"


def figures_of(streams: list[int]) -> dict[str, Callable[[dict], float]]:
    """The figures compared, by name: how each is read from a run's figures (:func:`run_once`)."""
    tok_s: dict[str, Callable[[dict], float]] = {"1 stream tok/s": lambda f: f["single_tok_s"]}
    cpu: dict[str, Callable[[dict], float]] = {"1 stream CPU µs/token": lambda f: sum(f["single_cpu_s"].values()) * 1e6}
    for n in streams:
        tok_s[f"{n} streams tok/s"] = lambda f, n=n: f["many"][n]["tok_s"]
        cpu[f"{n} streams CPU µs/token"] = lambda f, n=n: sum(f["many"][n]["cpu_s"].values()) * 1e6
    return {**tok_s, **cpu}


def add_round_arguments(parser: argparse.ArgumentParser, rounds: int, tokens: int, streams: int) -> None:
    """The options of alternated bench_stack.py rounds (what :func:`run_once` reads), with these defaults."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--streams", type=int, nargs="+", default=[streams],
                        help="concurrent streams of the many-stream figures: one bench_stack.py run per count")
    parser.add_argument("--cpu-proxy", action=argparse.BooleanOptionalAction, default=True,
                        help="bench_stack.py's tiny model, torch on one thread (ab_stack's default; guard.py's is the real model)")


def compare(args: argparse.Namespace, weights: list[str | None]) -> None:
    """``args.rounds`` rounds of this tree against ``args.base``, once per ``weights`` setting in each
    round (None: the caller's environment), the trees' order swapping each round; prints each run,
    then per setting the medians and ratios."""
    work = Path(tempfile.mkdtemp(prefix="tiller-ab-"))
    base = work / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True,
                   capture_output=True)
    trees = {"this": ROOT, args.base: base}
    runs: dict[str | None, dict[str, list[dict]]] = {w: {name: [] for name in trees} for w in weights}
    try:
        for round_no in range(args.rounds):
            order = list(trees) if round_no % 2 == 0 else list(reversed(trees))
            for w in weights:
                for name in order:
                    out = work / f"{round_no}-{w}-{order.index(name)}.json"
                    figures = run_once(trees[name], args, out, None if w is None else {"TILLER_WEIGHTS": w})
                    runs[w][name].append(figures)
                    print_round(round_no, name if w is None else f"{w} {name}", figures)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    for w in weights:
        if w is not None:
            print(f"weights={w}")
        report(runs[w], "this", args.base, args.streams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare this checkout against")
    add_round_arguments(parser, rounds=4, tokens=256, streams=8)
    parser.add_argument("--weights", nargs="+", default=None,
                        help="TILLER_WEIGHTS settings to run each round, e.g. auto fp32 (default: the environment's)")
    args = parser.parse_args()
    compare(args, args.weights or [None])


def print_round(round_no: int, name: str, figures: dict) -> None:
    many = "; ".join(f"{n} streams {m['tok_s']:7.1f} tok/s, CPU µs/token {cpu_us(m['cpu_s'])}"
                     for n, m in figures["many"].items())
    print(f"round {round_no + 1} {name:>10}: 1 stream {figures['single_tok_s']:7.1f} tok/s, CPU µs/token "
          f"{cpu_us(figures['single_cpu_s'])}; {many}  [load {os.getloadavg()[0]:.1f}]", flush=True)


def report(runs: dict[str, list[dict]], mine_name: str, theirs_name: str, streams: list[int]) -> None:
    """Per figure, the medians of both sides' rounds, their ratio and the median of the rounds' own ratios."""
    print(f"{'median over the rounds':28s} {mine_name:>10} {theirs_name:>10} {'ratio':>8} {'paired':>8}")
    for figure, value in figures_of(streams).items():
        mine = [value(f) for f in runs[mine_name]]
        theirs = [value(f) for f in runs[theirs_name]]
        paired = statistics.median(a / b for a, b in zip(mine, theirs))
        print(f"{figure:28s} {statistics.median(mine):10.1f} {statistics.median(theirs):10.1f} "
              f"{statistics.median(mine) / statistics.median(theirs):8.3f} {paired:8.3f}")
    print(f"ratio: {mine_name}'s median / {theirs_name}'s; paired: the median of the rounds' own ratios "
          "(each round's two runs ran back to back)")


if __name__ == "__main__":
    main()
