"""Weight-only packed CPU kernels against dense matmuls, over a whole model's projections.

    OMP_NUM_THREADS=2 .venv/bin/python deploy/loadtest/quant_kernels_bench.py [--rows 1 16] [--passes 20] [--kernels ...]

Builds SmolLM2-135M's 121 projections (30 layers of fused q|k|v, o, fused gate|up and down, and the
output head over the 49152-token vocabulary; random weights) once per kernel, and times passes
over all of them in order, as a decode step runs them: the weights stream from memory rather
than sit in cache, which a loop over one matrix would hide. Kernels:

* ``fp32``: dense float32, transposed and contiguous, on torch's (MKL's) matmul (what
  ``TILLER_WEIGHTS=fp32`` runs on a GPU, or a CPU without Tiller's kernel)
* ``bf16``: dense bfloat16, the same layout
* ``int4``: ``_weight_int4pack_mm_for_cpu``, a scale and zero per 32 weights rounded to bfloat16
  (the head: Q8_0 as two 4-bit halves, see services/worker/quantized.py)
* ``int4 exact``: the same with each scale and zero as two bfloat16 parts (holds GGUF blocks exactly)
* ``int8/row``: ``_weight_int8pack_mm``, one scale per output row (``TILLER_WEIGHTS=int8``)
* ``fp32 tiles``, ``bf16 tiles``: the dense weights in Tiller's kernel's tiles, float32 activations
  (what ``TILLER_WEIGHTS=fp32`` runs on a CPU where the kernel builds; bf16: a bfloat16 checkpoint)
* ``tiller``: Tiller's own kernel on the blocks as they ship (``TILLER_WEIGHTS=gguf``): float32
  activations, each code read once, float16 scales (built into the settings' cache if needed)
* ``tiller Q4_K``, ``tiller K8``: the same codes in the kernel's records for a GGUF's K-quants: Q4_K's
  (nibbles, float32 scales and minimums) and K8's (signed bytes, a float32 scale per 16 inputs: what
  Q5_0, Q5_1, Q5_K and Q6_K blocks are served as)

torch's packed kernels run on bfloat16 activations (their float32 path is not vectorized: 5-150x
slower than dense float32, printed once for reference). Kernels alternate pass by pass, so a busy
machine skews them alike; prints the median pass and per-layer-kind time with ratios to the first
kernel named (fp32 by default).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from common.config import Settings
from services.worker import kernel_build
from services.worker.gguf_blocks import GROUP, Blocks
from services.worker.gguf_linear import BlockLinear
from services.worker.quantized import Int4Packed, Int8Packed

LAYERS = 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)
Fn = Callable[[torch.Tensor], torch.Tensor]


def _blocks(kind: str, k: int, n: int, seed: int) -> Blocks:
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(n, k // GROUP, generator=g) * 0.01).half().float()
    if kind == "Q8_0":
        return Blocks(kind, torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), scale, None)
    return Blocks(kind, torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scale, (-8 * scale).half().float())


def _dense(weight: torch.Tensor, dtype: torch.dtype) -> Fn:
    weight_t = weight.t().contiguous().to(dtype)
    return lambda x: torch.mm(x.to(dtype), weight_t).float()


def build(kernel: str) -> list[tuple[str, Fn]]:
    """The model's projections in order, as ``kernel`` runs them."""
    shapes = [(name, shape, "Q4_1") for _ in range(LAYERS) for name, shape in SHAPES.items()]
    out: list[tuple[str, Fn]] = []
    for seed, (name, (k, n), kind) in enumerate([*shapes, ("head", HEAD, "Q8_0")]):
        blocks = _blocks(kind, k, n, seed)
        if kernel == "fp32":
            out.append((name, _dense(blocks.dequantize(), torch.float32)))
        elif kernel == "bf16":
            out.append((name, _dense(blocks.dequantize(), torch.bfloat16)))
        elif kernel == "int4":
            out.append((name, Int4Packed.of(blocks, None, parts=1)))
        elif kernel == "int4 exact":
            out.append((name, Int4Packed.of(blocks, None, parts=2)))
        elif kernel == "tiller":
            out.append((name, BlockLinear.of(blocks, None)))
        elif kernel == "tiller Q4_K":
            as_q4_k = Blocks("Q4_K", blocks.q, blocks.scale, blocks.minimum) if blocks.kind == "Q4_1" else blocks
            out.append((name, BlockLinear.of(as_q4_k, None)))  # (the head stays Q8_0)
        elif kernel == "tiller K8":
            out.append((name, BlockLinear.of(blocks.to_k8(), None)))
        elif kernel.endswith(" tiles"):
            dtype = torch.float32 if kernel == "fp32 tiles" else torch.bfloat16
            out.append((name, BlockLinear.of_dense(blocks.dequantize().to(dtype), None)))
        else:
            out.append((name, Int8Packed(blocks.dequantize(), None)))
    return out


def fp32_activation_note() -> None:
    """One mid-sized matrix with float32 activations on the packed kernels, for the docstring's claim."""
    k, n = SHAPES["qkv"]
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.rand(k // GROUP, n, 2)
    weight_t = torch.randn(k, n)
    x = torch.randn(16, k)
    times = {}
    for name, fn in {"fp32 dense": lambda: torch.mm(x, weight_t),
                     "int4 on fp32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)}.items():
        fn()
        started = time.perf_counter()
        for _ in range(5):
            fn()
        times[name] = (time.perf_counter() - started) / 5 * 1e6
    print(f"float32 activations, qkv, 16 rows: fp32 dense {times['fp32 dense']:.0f} µs, "
          f"int4 kernel {times['int4 on fp32']:.0f} µs ({times['int4 on fp32'] / times['fp32 dense']:.0f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--kernels", nargs="+", default=["fp32", "bf16", "int4", "int4 exact", "int8/row", "tiller"])
    args = parser.parse_args()
    kernels = args.kernels
    if any(k.startswith("tiller") or k.endswith(" tiles") for k in kernels) and not kernel_build.load(Settings().cache_dir):
        raise SystemExit("Tiller's kernel did not build (see the log above)")
    print(f"threads={torch.get_num_threads()} cpu={torch.backends.cpu.get_cpu_capability()} passes={args.passes}")
    fp32_activation_note()
    models = {kernel: build(kernel) for kernel in kernels}
    names = [*SHAPES, "head"]
    print(f"{'rows':>4} {'kernel':<11}{'pass ms':>14}" + "".join(f"{name + ' ms':>16}" for name in names))
    with torch.inference_mode():
        for rows in args.rows:
            x = {k: torch.randn(rows, k) for k in {576, 1536}}
            passes: dict[str, list[float]] = {kernel: [] for kernel in kernels}
            layer: dict[tuple[str, str], list[float]] = {}
            for i in range(args.passes + 1):  # the first pass warms up
                for kernel in kernels:
                    total = 0.0
                    for name, fn in models[kernel]:
                        inp = x[1536 if name == "down" else 576]
                        started = time.perf_counter()
                        fn(inp)
                        spent = time.perf_counter() - started
                        total += spent
                        if i:
                            layer.setdefault((kernel, name), []).append(spent)
                    if i:
                        passes[kernel].append(total)
            base = statistics.median(passes[kernels[0]])
            base_layer = {name: statistics.median(layer[(kernels[0], name)]) for name in names}
            for kernel in kernels:
                med = statistics.median(passes[kernel])
                per = {name: statistics.median(layer[(kernel, name)]) for name in names}
                count = {name: LAYERS if name != "head" else 1 for name in names}
                print(f"{rows:>4} {kernel:<11}{med * 1e3:>7.2f} ({med / base:.2f})" + "".join(
                    f"{per[name] * count[name] * 1e3:>9.2f} ({per[name] / base_layer[name]:.2f})" for name in names))


if __name__ == "__main__":
    main()
