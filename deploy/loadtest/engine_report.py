"""The engine's figures in one run, each next to its target: the worker engine against plain
``transformers.generate`` at every batch size for each model (``worker_bench.py``), then one stream
and many through the whole stack against the engine's own batch-1 speed (``bench_stack.py``).

The targets are the GPU ones (an H100 or H200, bf16, the default model's shapes and Llama-1B's at
random weights): a decode step at batch 1 within 1 ms; at batch 256, 100,000 tokens/s for the
default model's shapes and 60,000 for Llama-1B's; one stream through the whole stack at 90% or more
of the engine's own batch-1 speed; greedy tokens equal to generate's (judged in float32 only: in bf16 the
engine's kernels and generate's round differently, and near-ties part them; the float32 GPU oracle is
``tests/worker/test_worker_cuda.py``). On a CPU the same figures are printed (the served path against
generate, for CI's machine kind) and the GPU targets are not judged.

    # a GPU machine without the embedded model: save its config and tokenizer here, carry the folder
    python deploy/loadtest/engine_report.py --save-model .gpu/smollm2
    TILLER_DEVICE=cuda TILLER_MODEL=random:$PWD/.gpu/smollm2 python deploy/loadtest/engine_report.py
    # a CPU: the default model, batch 1 and 16
    python deploy/loadtest/engine_report.py

On a GPU the defaults are ``--models <TILLER_MODEL> llama-1b --batch 1 16 64 256 --gpu-kernels torch
triton --stack-tokens 256 --stack-streams 64`` (each model's engine once on torch's ops around the
matmuls, with attention over a gather of the KV blocks, and once on Tiller's Triton kernels, which
read them in place; the stack serves the ``gpu_kernels`` setting); on a CPU,
``--models <TILLER_MODEL> --batch 1 16 --stack-tokens 128 --stack-streams 16``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_stack  # noqa: E402
import worker_bench  # noqa: E402

from common.config import get_settings  # noqa: E402
from services.worker.model_loader import pick_device, pick_dtype  # noqa: E402

STEP_MS_AT_1 = 1.0
TOK_S_AT_256 = {"llama-1b": 60_000.0}  # any other model: the default model's target
DEFAULT_TOK_S_AT_256 = 100_000.0
STACK_SHARE = 0.90


@dataclass
class Check:
    what: str
    measured: str
    met: bool | None  # None: not judged (a CPU run, or the figure was not measured)


def engine_checks(spec: str, label: str, rows: list[worker_bench.Figures], on_gpu: bool,
                  exact: bool) -> list[Check]:
    """``spec``'s targets judged on ``rows``, the checks named by ``label``."""
    by = {(row.impl, row.batch): row for row in rows}
    checks = []
    if ("engine", 1) in by:
        step = by[("engine", 1)].step_ms
        checks.append(Check(f"{label}: decode step at batch 1 <= {STEP_MS_AT_1:g} ms", f"{step:.2f} ms",
                            step <= STEP_MS_AT_1 if on_gpu else None))
    if ("engine", 256) in by:
        target = TOK_S_AT_256.get(spec, DEFAULT_TOK_S_AT_256)
        tok_s = by[("engine", 256)].decode_tok_s
        checks.append(Check(f"{label}: batch 256 >= {target:,.0f} tok/s", f"{tok_s:,.0f} tok/s",
                            tok_s >= target if on_gpu else None))
    for row in rows:
        if row.impl != "generate":
            checks.append(Check(f"{label}: {row.impl} batch {row.batch} greedy tokens equal generate's", row.greedy,
                                row.greedy == "equal" if exact else None))
    return checks


def stack_check(figures: bench_stack.StackFigures, on_gpu: bool) -> Check:
    share = figures.single_vs_engine
    return Check(f"one stream through the stack >= {STACK_SHARE:.0%} of the engine's batch-1 speed",
                 f"{share:.0%} ({figures.single_tok_s:.0f} of {figures.engine_tok_s:.0f} tok/s)",
                 share >= STACK_SHARE if on_gpu else None)


def print_checks(checks: list[Check], on_gpu: bool) -> None:
    width = max(len(c.what) for c in checks)
    print(f"\n{'target':{width}}  {'measured':30}  verdict" + ("" if on_gpu else "  (a CPU run: GPU targets not judged)"))
    for c in checks:
        verdict = "-" if c.met is None else "met" if c.met else "MISSED"
        print(f"{c.what:{width}}  {c.measured:30}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", help="worker_bench models (default: see above)")
    parser.add_argument("--batch", type=int, nargs="+", help="batch sizes (default: see above)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per engine run")
    parser.add_argument("--repeats", type=int, default=2, help="best of N engine runs")
    parser.add_argument("--gpu-kernels", nargs="+", choices=["torch", "triton"],
                        help="gpu_kernels settings to run the engine with (default: see above)")
    parser.add_argument("--stack-tokens", type=int, help="tokens per stream through the stack (default: see above)")
    parser.add_argument("--stack-streams", type=int, help="concurrent streams for the aggregate (default: see above)")
    parser.add_argument("--no-stack", action="store_true", help="the engine figures only")
    parser.add_argument("--save-model", type=Path, metavar="DIR",
                        help="only save the default model's config and tokenizer (no weights) in DIR, then exit")
    args = parser.parse_args()
    if args.save_model is not None:
        print(f"saved: serve as random:{bench_stack.save_model_without_weights(args.save_model)}")
        return

    settings = get_settings()
    device = pick_device(settings.device)
    on_gpu = device.type == "cuda"
    exact = pick_dtype(settings.dtype, device) == torch.float32
    models = args.models or ([settings.model, "llama-1b"] if on_gpu else [settings.model])
    batches = args.batch or ([1, 16, 64, 256] if on_gpu else [1, 16])
    kernels = args.gpu_kernels or (["torch", "triton"] if on_gpu else [settings.gpu_kernels])
    checks: list[Check] = []
    for spec in models:
        for choice in kernels:
            rows = worker_bench.bench_model(spec, settings.model_copy(update={"gpu_kernels": choice}), batches,
                                            args.new_tokens, args.repeats)
            label = f"{spec} ({choice})" if len(kernels) > 1 else spec
            checks += engine_checks(spec, label, rows, on_gpu, exact)
    if not args.no_stack:
        print()
        tokens, streams = (args.stack_tokens or (256 if on_gpu else 128)), (args.stack_streams or (64 if on_gpu else 16))
        checks.append(stack_check(bench_stack.measure(tokens, streams), on_gpu))
    print_checks(checks, on_gpu)


if __name__ == "__main__":
    main()
