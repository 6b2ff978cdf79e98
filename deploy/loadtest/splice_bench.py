"""What running short inputs as decode rows saves: a step with one spliced sequence, both ways, paired.

    .venv/bin/python deploy/loadtest/splice_bench.py [--batch 16] [--context 128] [--splices 1 5 8 12 16 24]
        [--pairs 15] [--steps 3]

Builds the worker's engine on the configured model and weights (``TILLER_MODEL``, ``TILLER_WEIGHTS``; the
default model's GGUF blocks are what the worker serves on a CPU). Each step feeds ``batch - 1`` sequences one
token at ``context`` keys and the first sequence a splice of N tokens, as a controller's forced tokens arrive.
The native forward runs such an input as decode rows up to ``layers.plan.DECODE_ROWS_MAX`` tokens and as a
prefill beyond; the bench switches that threshold between the two ways step batch by step batch (the order
turning each pair), so that a shared machine's load falls on both alike, and prints per splice length the
medians of the process's CPU ms per step each way and of the pairs' ratios (decode rows / prefill; below 1:
decode rows cost less). A splice of 1 runs the same path both ways: its ratio is the control.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.config import get_settings
from services.worker.engine import Engine
from services.worker.kv_cache import BLOCK_SIZE
from services.worker.layers import plan
from services.worker.model_loader import load_model
from services.worker.models.paged import PagedModel
from services.worker.runner import SeqInput


def spliced_steps(runner: PagedModel, batch: int, context: int, splice: int, steps: int) -> float:
    """CPU ms per step of ``steps`` steps, each from ``context`` on (the slots' old values do not change a
    step's cost): sequence 0 fed ``splice`` tokens, the others one each."""
    began = time.process_time()
    for i in range(steps):
        inputs = [SeqInput(seq_id=0, tokens=[1] * splice, start=context + i * splice, logits=True)]
        inputs += [SeqInput(seq_id=s, tokens=[1 + s], start=context + i, logits=True) for s in range(1, batch)]
        with torch.inference_mode():
            runner.forward(inputs)
    return (time.process_time() - began) * 1000 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--splices", type=int, nargs="+", default=[1, 5, 8, 12, 16, 24])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="steps per measurement")
    args = parser.parse_args()
    settings = get_settings()
    loaded = load_model(settings, lambda percent, message: None)
    longest = args.context + (args.steps + 1) * max(args.splices)
    engine = Engine(loaded, num_blocks=args.batch * -(-longest // BLOCK_SIZE) + 1)
    runner = engine.runner
    if not isinstance(runner, PagedModel):
        raise SystemExit(f"the model runs on the {engine.backend} backend, not the native forward")
    for seq_id in range(args.batch):
        engine.tables.reserve(seq_id, longest)
    engine.cache.kv.normal_(generator=torch.Generator().manual_seed(0))
    ways = {"decode rows": max(args.splices), "prefill": 1}  # the threshold each way
    print(f"model={settings.model} weights={loaded.weights} backend={engine.backend} threads={torch.get_num_threads()} "
          f"batch={args.batch} context={args.context} pairs={args.pairs} steps={args.steps}")
    print(f"{'splice':>7}{'decode rows':>13}{'prefill':>10}{'ratio':>8}   (CPU ms per step, medians)")
    kept = plan.DECODE_ROWS_MAX
    try:
        for splice in args.splices:
            times: dict[str, list[float]] = {way: [] for way in ways}
            for pair in range(args.pairs):
                for way in (list(ways) if pair % 2 else list(ways)[::-1]):
                    plan.DECODE_ROWS_MAX = ways[way]
                    spliced_steps(runner, args.batch, args.context, splice, 1)  # warm-up
                    times[way].append(spliced_steps(runner, args.batch, args.context, splice, args.steps))
            rows, prefill = times["decode rows"], times["prefill"]
            ratio = statistics.median(a / b for a, b in zip(rows, prefill))
            print(f"{splice:>7}{statistics.median(rows):>13.2f}{statistics.median(prefill):>10.2f}{ratio:>8.3f}",
                  flush=True)
    finally:
        plan.DECODE_ROWS_MAX = kept


if __name__ == "__main__":
    main()
