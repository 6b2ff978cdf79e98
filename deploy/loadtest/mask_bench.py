"""What a controllers' mask costs the worker's sampling, beside the same sampling without one.

    OMP_NUM_THREADS=1 .venv/bin/python deploy/loadtest/mask_bench.py [--rows 1 16 64] [--vocab 49152] [--steps 200]
                                                                      [--no-kernel]

Per batch of ``rows`` greedy sequences (random logits, random packed mask rows of ``vocab`` tokens), the
process's CPU microseconds per step of each part the engine runs for a masked step: checking that each row
allows a token (``mask_allows_any``), the logits with the masks applied (``masked_scores``: the kernel
library's op, built into the settings' cache as a worker does, or with ``--no-kernel`` the additive bias a
worker without the library adds), and sampling them; then sampling the same logits without a mask, the
baseline, and the masked step's total against it. The parts take turns; each figure is the best of
``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from common.config import Settings
from common.wire import SamplingParams
from services.worker import kernel_build
from services.worker.sampler import SeqSampler, mask_allows_any, masked_scores, sample


def cpu_us(fn: Callable[[], object], steps: int) -> float:
    """The process's CPU microseconds per call of ``fn``."""
    started = time.process_time()
    for _ in range(steps):
        fn()
    return (time.process_time() - started) / steps * 1e6


def bench(rows: int, vocab: int, steps: int, repeats: int) -> str:
    rng = np.random.default_rng(rows)
    words = rng.integers(-(2**31), 2**31, size=(rows, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    packed = torch.from_numpy(words)
    logits = torch.randn(rows, vocab)
    samplers = [SeqSampler(SamplingParams(temperature=0.0)) for _ in range(rows)]
    histories = [[1, 2, 3]] * rows
    masked = masked_scores(logits, packed, vocab)
    parts = {
        "allows_any": lambda: mask_allows_any(words, vocab),
        "masked_scores": lambda: masked_scores(logits, packed, vocab),
        "sample+mask": lambda: sample(logits, samplers, histories, masked),
        "sample": lambda: sample(logits, samplers, histories),
    }
    best = dict.fromkeys(parts, float("inf"))
    for _ in range(repeats):  # the parts take turns, so a busy spell spoils all of them alike
        for name, fn in parts.items():
            best[name] = min(best[name], cpu_us(fn, steps))
    masked_us = best["allows_any"] + best["masked_scores"] + best["sample+mask"]
    figures = "  ".join(f"{name} {us:8.1f}" for name, us in best.items())
    total = f"masked total {masked_us:8.1f} = {masked_us / best['sample']:.2f}x unmasked"
    return f"rows {rows:3d}: CPU us/step  {figures}  | {total}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152, help="the default model's vocabulary")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-kernel", action="store_true", help="apply the masks as an additive bias")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not args.no_kernel and not kernel_build.load(Settings().cache_dir):
        print("the kernel library is unavailable (see the log above): masks applied as an additive bias")
    for rows in args.rows:
        print(bench(rows, args.vocab, args.steps, args.repeats), flush=True)


if __name__ == "__main__":
    main()
