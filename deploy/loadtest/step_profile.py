"""Where a CPU decode step's time goes, with the linear layers set apart.

    OMP_NUM_THREADS=1 .venv/bin/python deploy/loadtest/step_profile.py [--shapes 1x128 16x128 16x512]
        [--steps 20] [--repeats 2] [--no-ops]

Builds the worker's engine on the configured model and weights (``TILLER_MODEL``, ``TILLER_WEIGHTS``),
gives each of ``batch`` sequences ``context`` tokens of random keys and values (the values do not
change the cost of a step), and runs decode steps through the native forward. Per shape it prints
the process's CPU milliseconds per step (the figure a shared machine skews least):

* ``all``: the forward as it runs;
* ``non-linear``: the same with every projection (and the output head) replaced by a stand-in that
  returns a ready tensor of the right shape, so what is left is attention, rotary, norms, the
  activation, the KV write, residual adds and the Python around them;
* ``linear``: the difference;
* ``sample``: greedy sampling of the step's logits (argmax and logprobs, as the engine does).

Where the runner has the kernel library's fused ops (``TILLER_WEIGHTS=gguf``), each shape gets three
rows, measured in turns on the same engine: ``ops=torch`` (the ops switched off, torch's path: the
baseline), ``ops=fused`` (one fused op per step of a layer) and ``ops=layer`` (a whole decoder layer per
call, as the worker runs decode steps; its stand-in projections are not block layers, so its
``non-linear`` column is the ``fused`` path's and ``linear`` is left out). The forward variants take turns ``--repeats`` times; each figure is the best. Unless
``--no-ops``, a profile of the non-linear steps follows: each top-level torch op's share of
the profiled time and its calls per decode step and per layer. The profiler times wall clock
and adds its own cost per op, so read the shares and counts, not its microseconds.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common.config import get_settings
from common.wire import SamplingParams
from services.worker.engine import Engine
from services.worker.kv_cache import BLOCK_SIZE
from services.worker.model_loader import load_model
from services.worker.models.llama import LlamaLayer
from services.worker.models.paged import PagedModel
from services.worker.runner import SeqInput
from services.worker.sampler import SeqSampler, sample


class StandIn:
    """A projection that costs nothing but the residual add: returns one ready tensor per row count."""

    def __init__(self, out_features: int) -> None:
        self.out_features = out_features
        self._outs: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._outs.get(x.shape[0])
        if out is None:
            out = self._outs[x.shape[0]] = torch.randn(x.shape[0], self.out_features) * 0.1
        return out

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x.add(self(h))


class Projections:
    """Swaps a runner's projections for stand-ins and back."""

    def __init__(self, runner: PagedModel) -> None:
        self.runner = runner
        self.layers: list[LlamaLayer] = [layer for layer in runner.layers if isinstance(layer, LlamaLayer)]
        self.real = [layer.projections() for layer in self.layers], runner.head
        self.fake = ([tuple(StandIn(m.out_features) for m in linears) for linears in self.real[0]],
                     StandIn(runner.head.out_features))

    def use(self, fake: bool) -> None:
        layers, head = self.fake if fake else self.real
        for layer, (qkv, o, gate_up, down) in zip(self.layers, layers):
            layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down = qkv, o, gate_up, down
        self.runner.head = head


def decode_steps(runner: PagedModel, batch: int, start: int, steps: int) -> float:
    """CPU ms per step of ``steps`` decode steps of sequences 0..batch-1 from position ``start``."""
    began = time.process_time()
    for i in range(steps):
        inputs = [SeqInput(seq_id=s, tokens=[1 + s], start=start + i, logits=True) for s in range(batch)]
        with torch.inference_mode():
            runner.forward(inputs)
    return (time.process_time() - began) * 1000 / steps


def sample_ms(batch: int, vocab: int, repeats: int = 50) -> float:
    logits = torch.randn(batch, vocab) * 5
    samplers = [SeqSampler(SamplingParams(temperature=0)) for _ in range(batch)]
    histories = [[1, 2, 3]] * batch
    sample(logits, samplers, histories)
    began = time.process_time()
    for _ in range(repeats):
        sample(logits, samplers, histories)
    return (time.process_time() - began) * 1000 / repeats


def op_table(runner: PagedModel, batch: int, start: int, steps: int) -> None:
    """The profiler's top-level ops of ``steps`` decode steps (projections should be stand-ins)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_steps(runner, batch, start, steps)
    total: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.cpu_parent is None:
            total[event.name] += event.cpu_time_total
            calls[event.name] += 1
    overall = sum(total.values())
    layers = len(runner.layers)
    print(f"  {'op':<44}{'share':>7}{'calls/step':>12}{'per layer':>11}")
    for name, t in total.most_common(16):
        print(f"  {name:<44}{100 * t / overall:>6.1f}%{calls[name] / steps:>12.1f}{calls[name] / steps / layers:>11.2f}")
    print(f"  {'(all ops)':<44}{100.0:>6.1f}%{sum(calls.values()) / steps:>12.1f}"
          f"{sum(calls.values()) / steps / layers:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1x128", "1x512", "16x128", "16x512"],
                        help="BATCHxCONTEXT decode shapes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-ops", action="store_true", help="skip the profiler's op table")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes]
    settings = get_settings()
    loaded = load_model(settings, lambda percent, message: None)
    longest = max(c for _, c in shapes) + (6 * args.repeats + 2) * (args.steps + 1)  # 3 variants x 2 forwards
    engine = Engine(loaded, num_blocks=max(b for b, _ in shapes) * -(-longest // BLOCK_SIZE) + 1)
    runner = engine.runner
    if not isinstance(runner, PagedModel):
        raise SystemExit(f"the model runs on the {engine.backend} backend, not the native forward")
    projections = Projections(runner)
    variants = {"torch": (None, False)}
    if runner.kernels.ops is not None:
        variants |= {"fused": (runner.kernels.ops, False), "layer": (runner.kernels.ops, True)}
    print(f"model={settings.model} weights={loaded.weights} threads={torch.get_num_threads()} "
          f"steps={args.steps} repeats={args.repeats}")
    print(f"{'batch':>6}{'context':>9}{'ops':>7}{'all':>9}{'non-linear':>12}{'linear':>9}{'sample':>9}"
          "   (CPU ms per decode step)")
    generator = torch.Generator().manual_seed(0)
    for batch, context in shapes:
        for seq_id in list(engine.tables.seqs):
            engine.tables.release(seq_id)
        for seq_id in range(batch):
            engine.tables.reserve(seq_id, longest)
        engine.cache.kv.normal_(generator=generator)
        best = {(name, fake): float("inf") for name in variants for fake in (False, True)}
        position = context
        for _ in range(args.repeats):
            for name, (ops, whole) in variants.items():
                runner.kernels.ops, runner.kernels.whole_layers = ops, whole
                for fake in (False, True):
                    projections.use(fake)
                    decode_steps(runner, batch, position, 1)  # warm-up
                    best[name, fake] = min(best[name, fake], decode_steps(runner, batch, position + 1, args.steps))
                    position += args.steps + 1
        sampled = sample_ms(batch, loaded.vocab_size)
        for name in variants:
            every, rest = best[name, False], best[name, True]
            linear = f"{every - rest:>9.2f}" if name != "layer" else f"{'-':>9}"
            print(f"{batch:>6}{context:>9}{name:>7}{every:>9.2f}{rest:>12.2f}{linear}{sampled:>9.2f}", flush=True)
        if not args.no_ops:
            projections.use(True)
            op_table(runner, batch, position, args.steps)
        projections.use(False)


if __name__ == "__main__":
    main()
