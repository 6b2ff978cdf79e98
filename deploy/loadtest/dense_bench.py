"""Dense weights on Tiller's kernel's tiles against torch's matmuls (MKL), in one process on one loaded
model, alternated round by round: the default model converted to float32 (``TILLER_WEIGHTS=fp32``),
113-token prompts, decode steps of ``--batch`` sequences. Prints the median wall and CPU ms per decode
step of each engine, their tokens/s and the ratio.

    OMP_NUM_THREADS=2 .venv/bin/python deploy/loadtest/dense_bench.py [--batch 1 16 64] [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from common.config import Settings
from common.wire import SamplingParams, SeqStep, Step, pack_ids
from services.worker.engine import Engine
from services.worker.model_loader import load_model

PROMPT = list(range(1000, 1113))
GREEDY = SamplingParams(temperature=0)


def decode_steps(engine: Engine, batch: int, steps: int, first_id: int) -> list[tuple[float, float]]:
    """(wall s, CPU s) of each of ``steps`` decode steps of ``batch`` fresh sequences."""
    ids = [first_id + i for i in range(batch)]
    engine.step(Step(step_id=1, seqs=[SeqStep(seq_id=s, tokens=PROMPT, sampling=GREEDY) for s in ids]))
    times = []
    for k in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step(Step(step_id=2 + k, seqs=[], follows=pack_ids(ids)))
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    engine.step(Step(step_id=steps + 2, seqs=[], free=ids))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    loaded = load_model(Settings(device="cpu", weights="fp32"), lambda progress, message: None, keep_dense=True)
    if not loaded.kernel:
        raise SystemExit("Tiller's kernel did not build here: there are no tiles to compare")
    blocks = max(args.batch) * -(-(len(PROMPT) + args.steps + 16) // 16) + 1
    engines = {"tiles": Engine(loaded, num_blocks=blocks),
               "torch": Engine(dataclasses.replace(loaded, linears=None, kernel=False), num_blocks=blocks)}
    print(f"threads={torch.get_num_threads()} cpu={torch.backends.cpu.get_cpu_capability()} rounds={args.rounds}")
    for batch in args.batch:
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        for round_no in range(args.rounds):
            for name, engine in engines.items():
                runs[name] += decode_steps(engine, batch, args.steps, 10_000 * round_no + 100 * batch)
        wall = {name: statistics.median(w for w, _ in times) * 1e3 for name, times in runs.items()}
        cpu = {name: statistics.median(c for _, c in times) * 1e3 for name, times in runs.items()}
        print(f"batch {batch:3d}: tiles {wall['tiles']:7.1f} ms/step (CPU {cpu['tiles']:7.1f}) "
              f"{batch * 1e3 / wall['tiles']:7.1f} tok/s | torch {wall['torch']:7.1f} ms/step (CPU {cpu['torch']:7.1f}) "
              f"{batch * 1e3 / wall['torch']:7.1f} tok/s | tiles {wall['torch'] / wall['tiles']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
