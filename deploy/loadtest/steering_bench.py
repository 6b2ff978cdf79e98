"""What activation steering costs the engine's decode: unsteered against steered sequences, in one run.

    .venv/bin/python deploy/loadtest/steering_bench.py [--weights auto fp32] [--batch 1 16 64] [--steps 32]
        [--rounds 3]

On the configured model (``smollm2`` by default, the embedded GGUF with ``TILLER_WEIGHTS``' weights; ``--weights``
runs each setting in turn), each batch of sequences is fed a short prompt, then decodes ``--steps`` tokens in steps
of the whole batch (``Step.follows``, as the scheduler sends them), in four ways: unsteered, every sequence steered
at one layer (the middle one), every sequence steered at every layer, and half of them steered at every layer (not
at batch 1). The ways alternate within each of ``--rounds`` rounds, so a busy spell of a shared machine hits them
alike; a figure is the best round's decode tokens/s, by wall time and by this process's CPU time, with its ratio
to the unsteered figure of the same batch. Each way's sequences are in a cache domain of their own (as the gateway
puts differently steered requests), and the last column says whether the steered first sequence's tokens differ
from the unsteered one's (the vectors are strong enough to show they were added).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from common.config import get_settings
from common.steering import SteeringVector, encode, vector_id
from common.wire import SamplingParams, SeqStep, SteeringTerm, Step, pack_ids, unpack_tokens
from services.worker.engine import Engine
from services.worker.kv_cache import BLOCK_SIZE
from services.worker.model_loader import LoadedModel, load_model

PROMPT = [(37 * i + 11) % 20000 + 100 for i in range(16)]
WAYS = ("unsteered", "one layer", "every layer", "half, every layer")


def _vector(layers: list[int], hidden: int, norm: float, seed: int) -> tuple[str, bytes]:
    rng = np.random.default_rng(seed)
    directions = {}
    for layer in layers:
        d = rng.standard_normal(hidden)
        directions[layer] = d / np.linalg.norm(d) * norm
    data = encode(SteeringVector.of(directions))
    return vector_id(data), data


def _decode(engine: Engine, batch: int, steps: int, steered: int, vector: tuple[str, bytes] | None,
            run: int, domain: str) -> tuple[float, float, list[int]]:
    """Wall and CPU seconds of ``steps`` decode steps of ``batch`` sequences, the first ``steered`` of them under
    ``vector``, and the first sequence's tokens."""
    seq_ids = [run * 1000 + i for i in range(batch)]
    greedy = SamplingParams(temperature=0, output_start=len(PROMPT))
    seqs = []
    for i, seq_id in enumerate(seq_ids):
        steer = vector is not None and i < steered
        seqs.append(SeqStep(seq_id=seq_id, tokens=PROMPT, sampling=greedy, cache_domain=f"{domain}/{steer}",
                            steering=[SteeringTerm(vector=vector[0], scale=1.0)] if steer else None,
                            vectors={vector[0]: vector[1]} if steer else {}))
    result = engine.step(Step(step_id=0, seqs=seqs))
    assert not result.failures, result.failures
    tokens = [unpack_tokens(result.tokens)[0]]
    follows = pack_ids(seq_ids)
    wall, cpu = time.perf_counter(), time.process_time()
    for step_id in range(1, steps + 1):
        result = engine.step(Step(step_id=step_id, seqs=[], follows=follows))
        tokens.append(unpack_tokens(result.tokens)[0])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    engine.free(seq_ids)
    return wall, cpu, tokens


def bench(loaded: LoadedModel, batches: list[int], steps: int, rounds: int, norm: float) -> None:
    text = loaded.config.get_text_config()
    layers, hidden = text.num_hidden_layers, text.hidden_size
    one = _vector([layers // 2], hidden, norm, seed=1)
    every = _vector(list(range(layers)), hidden, norm, seed=2)
    ways = {"unsteered": (None, 0), "one layer": (one, None), "every layer": (every, None),
            "half, every layer": (every, 0.5)}
    blocks = max(batches) * -(-(len(PROMPT) + steps + 1) // BLOCK_SIZE) + 2
    engine = Engine(loaded, num_blocks=blocks)
    print(f"\nmodel={loaded.name} weights={loaded.weights} backend={engine.backend} layers={layers} hidden={hidden} "
          f"threads={torch.get_num_threads()} steps={steps} rounds={rounds} norm={norm}")
    print(f"{'batch':>5}  {'way':<18}{'tok/s':>9}{'ratio':>7}{'cpu tok/s':>11}{'ratio':>7}  steered tokens")
    with torch.inference_mode():
        for batch in batches:
            chosen = [w for w in WAYS if batch > 1 or not w.startswith("half")]
            _decode(engine, batch, 2, batch, every, run=0, domain="warm")  # warm up: allocator, KV pages
            best: dict[str, tuple[float, float]] = {}
            tokens: dict[str, list[int]] = {}
            for r in range(rounds):
                order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]  # alternate who goes first
                for way in order:
                    vector, share = ways[way]
                    steered = batch if share is None else int(batch * share)
                    wall, cpu, first = _decode(engine, batch, steps, steered, vector, run=r + 1, domain=way)
                    wall_rate, cpu_rate = batch * steps / wall, batch * steps / cpu
                    old = best.get(way, (0.0, 0.0))
                    best[way] = (max(old[0], wall_rate), max(old[1], cpu_rate))
                    tokens[way] = first
            base = best["unsteered"]
            for way in chosen:
                wall_rate, cpu_rate = best[way]
                changed = "" if way == "unsteered" else ("differ" if tokens[way] != tokens["unsteered"] else "same")
                print(f"{batch:>5}  {way:<18}{wall_rate:>9.1f}{wall_rate / base[0]:>7.3f}{cpu_rate:>11.1f}"
                      f"{cpu_rate / base[1]:>7.3f}  {changed}", flush=True)
    del engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", nargs="+", default=None, help="weights settings to run (default: TILLER_WEIGHTS)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--norm", type=float, default=8.0, help="each direction's norm")
    args = parser.parse_args()
    settings = get_settings()
    for weights in args.weights or [settings.weights]:
        loaded = load_model(settings.model_copy(update={"weights": weights}), lambda progress, message: None)
        bench(loaded, args.batch, args.steps, args.rounds, args.norm)
        del loaded


if __name__ == "__main__":
    main()
