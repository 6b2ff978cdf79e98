"""Decode tokens/s of every native family at a small random-weight config: the native paged forward against
the transformers fallback on the same weights, at batch 1 and 16, in one run (nothing downloaded).

    .venv/bin/python deploy/loadtest/models_bench.py [--hidden 512] [--layers 4] [--batch 1 16] [--steps 32]
        [--only NAME ...]

Each sequence is fed a 32-token prompt, then every sequence decodes ``--steps`` tokens in steps of the
whole batch (the native forward batches them; the fallback runs them one by one, as it serves them). The
figure is the best of ``--repeats`` runs of the decode steps, in CPU time of this process (what a shared
machine skews least); torch's ops on float32 dense weights for both, so the two differ only in the forward.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from common.wire import SamplingParams, SeqStep, Step, pack_ids
from services.worker.engine import Engine
from services.worker.model_loader import LoadedModel
from services.worker.models.tiny import tiny_configs

PROMPT = 32


def decode_rate(engine: Engine, batch: int, steps: int, repeats: int) -> float:
    """Best decode tokens/s (CPU time) of ``batch`` sequences over ``steps`` steps."""
    best = 0.0
    for repeat in range(repeats):
        ids = list(range(1000 * repeat, 1000 * repeat + batch))
        prompts = [SeqStep(seq_id=s, tokens=[(s * 7 + i) % 500 + 1 for i in range(PROMPT)],
                           sampling=SamplingParams(temperature=0)) for s in ids]
        engine.step(Step(step_id=1, seqs=prompts))
        began = time.process_time()
        for step_id in range(steps):
            engine.step(Step(step_id=2 + step_id, seqs=[], follows=pack_ids(ids)))
        best = max(best, batch * steps / (time.process_time() - began))
        engine.free(ids)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these configs of models/tiny.py (default: all)")
    args = parser.parse_args()
    configs = tiny_configs(hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4, vocab=4096, window=64)
    if args.only:
        configs = {name: configs[name] for name in args.only}
    print(f"hidden={args.hidden} layers={args.layers} steps={args.steps} threads={torch.get_num_threads()} "
          "(decode tokens/s, CPU time; native / fallback)")
    print(f"{'family':<16}" + "".join(f"{f'batch {b}':>30}" for b in args.batch))
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        loaded = LoadedModel(model=model, config=model.config, name=name, device=torch.device("cpu"),
                             dtype=torch.float32, eos_token_ids=[], max_model_len=256)
        blocks = max(args.batch) * -(-(PROMPT + args.steps + 1) // 16) + 2
        native, fallback = Engine(loaded, num_blocks=blocks), Engine(loaded, num_blocks=blocks, native=False)
        cells = []
        with torch.inference_mode():
            for batch in args.batch:
                fast, slow = (decode_rate(e, batch, args.steps, args.repeats) for e in (native, fallback))
                cells.append(f"{fast:>9.1f} / {slow:>7.1f} ({fast / slow:>4.1f}x)")
        print(f"{name:<16}" + "".join(f"{cell:>30}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
