"""Decode speed of the worker engine vs ``transformers.generate`` (greedy, same prompt, same process).

    .venv/bin/python deploy/loadtest/worker_bench.py [--new-tokens 64] [--batch 1 16] [--repeats 3]

Reads the usual settings (TILLER_MODEL, TILLER_DEVICE, ...). For each batch size it prints, for
both, the prefill time (prompt to first token), the median ms per decode step and the decode
tokens/s it gives, and end-to-end tokens/s. Engine runs start with an empty prefix cache (cold
prefill, comparable with generate); the ``engine+pc`` row repeats them with the prompt's full
blocks already cached, as a second request sharing the prompt would find them. Each figure is the
best of ``--repeats`` runs, and steps are timed one by one (generate through a stopping
criterion), so a busy machine skews the medians less than the totals.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from common.config import get_settings
from common.model_source import load_tokenizer
from common.wire import SamplingParams, SeqStep, Step
from services.worker.engine import Engine
from services.worker.model_loader import load_model

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]


@dataclass
class Run:
    prefill_s: float  # from the start to the first token
    step_s: list[float]  # each later decode step

    @property
    def total_s(self) -> float:
        return self.prefill_s + sum(self.step_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class _StepClock(StoppingCriteria):
    """Timestamps every token generate produces (it asks once per step); never stops it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        _sync(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def bench_generate(model, prompt: list[int], batch: int, new_tokens: int, device: torch.device) -> Run:
    ids = torch.tensor([prompt] * batch, device=device)
    clock = _StepClock(device)
    _sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.config.eos_token_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    assert out.shape[1] == len(prompt) + new_tokens
    stamps = [started, *clock.stamps]
    return Run(prefill_s=stamps[1] - stamps[0], step_s=[b - a for a, b in zip(stamps[1:], stamps[2:])])


def bench_engine(engine: Engine, prompt: list[int], batch: int, new_tokens: int, run: int, warm: bool = False) -> Run:
    """``warm``: keep the prefix cache (the prompt's blocks are cached by earlier runs); else empty it."""
    greedy = SamplingParams(temperature=0)
    seq_ids = [run * 1000 + i for i in range(batch)]
    if not warm:
        engine.drop_prefix_cache()
    _sync(engine.device)
    started = time.perf_counter()
    result = engine.step(Step(step_id=0, seqs=[SeqStep(seq_id=s, tokens=prompt, sampling=greedy) for s in seq_ids]))
    _sync(engine.device)
    prefill = time.perf_counter() - started
    assert not result.failures, result.failures
    steps = []
    for step_id in range(1, new_tokens):
        started = time.perf_counter()
        seqs = [SeqStep(seq_id=s, tokens=[result.samples[s].token_id]) for s in seq_ids]
        result = engine.step(Step(step_id=step_id, seqs=seqs))
        _sync(engine.device)
        steps.append(time.perf_counter() - started)
    engine.free(seq_ids)
    return Run(prefill_s=prefill, step_s=steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs")
    args = parser.parse_args()

    settings = get_settings()
    loaded = load_model(settings, lambda progress, message: None)
    engine = Engine.create(loaded, settings)
    prompt = load_tokenizer(settings).apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
    n = args.new_tokens
    print(
        f"model={settings.model} device={loaded.device} dtype={loaded.dtype} threads={torch.get_num_threads()} "
        f"backend={engine.backend} prompt={len(prompt)} tokens new={n} repeats={args.repeats}"
    )
    # Warm both paths up once (allocator, kernels, lazy pages of the KV pool).
    bench_engine(engine, prompt, max(args.batch), 4, run=0)
    bench_generate(loaded.model, prompt, 1, 2, loaded.device)

    print(f"{'impl':<10}{'batch':>6}{'prefill ms':>12}{'ms/step':>10}{'decode tok/s':>14}{'e2e tok/s':>11}")
    e2e: dict[tuple[str, int], float] = {}
    for batch in args.batch:
        runs: dict[str, list[Run]] = {"generate": [], "engine": [], "engine+pc": []}
        for r in range(args.repeats):  # interleaved, so a busy spell hits both alike
            runs["generate"].append(bench_generate(loaded.model, prompt, batch, n, loaded.device))
            runs["engine"].append(bench_engine(engine, prompt, batch, n, run=r + 1))
            runs["engine+pc"].append(bench_engine(engine, prompt, batch, n, run=r + 101, warm=True))
        for impl, results in runs.items():
            prefill = min(run.prefill_s for run in results)
            step = min(statistics.median(run.step_s) for run in results)
            e2e[(impl, batch)] = batch * n / min(run.total_s for run in results)
            print(
                f"{impl:<10}{batch:>6}{prefill * 1000:>12.1f}{step * 1000:>10.2f}{batch / step:>14.1f}"
                f"{e2e[(impl, batch)]:>11.1f}"
            )
    if 1 in args.batch:
        for batch in args.batch:
            if batch != 1:
                ratio = e2e[("engine", batch)] / e2e[("engine", 1)]
                print(f"engine batch {batch} vs batch 1 (e2e tok/s): {ratio:.1f}x")


if __name__ == "__main__":
    main()
