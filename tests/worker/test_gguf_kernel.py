"""Tiller's GGUF block kernel (services/worker/gguf_kernel.cpp, gguf_linear.py, kernel_build.py).

Each layer must equal a float64 matmul over the dequantized blocks within float32 rounding, for every
block type (and dense float32, bfloat16 and float16 weights in the same tiles), one to three rows (the decode path that leaves the codes unscaled and scales each block's
sums) and more (the weights dequantized in registers, rows taken up to 16 at a time),
output features that fill no whole tile, a bias and a residual; and be closer to it than torch's
packed kernel on bfloat16 activations. A machine without a compiler gets a logged reason and no
kernel, never a failed start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from services.worker import gguf_kquants
from services.worker.gguf_blocks import GROUP, Blocks
from services.worker.gguf_linear import BlockLinear, dense_packable, pack, pack_dense
from services.worker.quantized import Int4Packed

FLOAT32_ROUNDING = 2e-6  # relative to sum(|x| |w|): float32 accumulation over up to 1,536 inputs, with margin


def _random_blocks(kind: str, out: int, inputs: int, seed: int) -> Blocks:
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(out, inputs // GROUP, generator=g) * 0.02).half().float()
    if kind == "Q8_0":
        return Blocks(kind, torch.randint(-128, 128, (out, inputs), generator=g, dtype=torch.int8), scale, None)
    minimum = (-torch.rand(out, inputs // GROUP, generator=g) * 0.2).half().float() if kind == "Q4_1" else None
    return Blocks(kind, torch.randint(0, 16, (out, inputs), generator=g, dtype=torch.uint8), scale, minimum)


def _check(blocks: Blocks, rows: int, seed: int = 0) -> tuple[float, float | None]:
    """The layer's largest error against float64 math, with bias and with residual, relative to
    ``sum(|x| |w|)``, also returned for torch's packed kernel on the same blocks (None: it takes
    whole tiles of 16 output features only)."""
    g = torch.Generator().manual_seed(seed)
    out, inputs = blocks.shape
    x = torch.randn(rows, inputs, generator=g)
    bias = torch.randn(out, generator=g)
    residual = torch.randn(rows, out, generator=g)
    weight = blocks.dequantize().double()
    exact = x.double() @ weight.t() + bias.double()
    size = x.double().abs() @ weight.abs().t() + bias.double().abs() + 1e-30
    layer = BlockLinear.of(blocks, bias)
    err = ((layer(x).double() - exact).abs() / size).max().item()
    with_residual = ((layer.add_to(residual, x).double() - residual.double() - exact).abs() / size).max().item()
    assert err <= FLOAT32_ROUNDING and with_residual <= FLOAT32_ROUNDING, (err, with_residual)
    unbiased = BlockLinear.of(blocks, None)
    assert ((unbiased(x).double() - exact + bias.double()).abs() / size).max().item() <= FLOAT32_ROUNDING
    if out % 16 or blocks.kind not in ("Q4_0", "Q4_1", "Q8_0"):  # what torch's packed kernel takes exactly
        return err, None
    torch_err = ((Int4Packed.of(blocks, bias, parts=2)(x).double() - exact).abs() / size).max().item()
    return err, torch_err


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 16, 5, 37])
@pytest.mark.parametrize("shape", [(40, 96), (576, 576), (3, 1536), (80, 64)])
def test_the_kernel_equals_a_float64_matmul_over_the_dequantized_blocks(gguf_kernel, kind, rows, shape) -> None:
    err, torch_err = _check(_random_blocks(kind, *shape, seed=rows), rows)
    assert torch_err is None or err < torch_err  # float32 activations: closer than bfloat16 ones


def _random_file_blocks(kind: str, out: int, inputs: int, seed: int) -> np.ndarray:
    """Random raw blocks of ``kind`` as a GGUF holds them, ``[out, bytes]``: random codes, sub-scales and
    high bits, and float16 scales (and minimums) of a trained model's size."""
    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out, inputs // weights, size), dtype=np.uint8)
    halves = [208] if kind == "Q6_K" else [0, 2] if kind in ("Q5_1", "Q4_K", "Q5_K") else [0]
    for at in halves:
        values = rng.uniform(1e-4, 2e-3, size=raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = values[..., None].view(np.uint8)
    return raw.reshape(out, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 3, 16, 5, 37])
@pytest.mark.parametrize("shape", [(40, 256), (576, 1536), (3, 512)])
def test_k_quants_equal_the_gguf_packages_dequantized_weights(gguf_kernel, kind, rows, shape) -> None:
    raw = _random_file_blocks(kind, *shape, seed=rows)
    blocks = gguf_kquants.decode(kind, raw)
    reference = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(shape)).double()
    assert torch.equal(blocks.dequantize().double(), reference)  # the unpacking is exact
    _check(blocks, rows)  # and the kernel's product is a float64 matmul's within float32 rounding
    assert BlockLinear.of(blocks, None).kind == ("Q4_K" if kind == "Q4_K" else "K8")


@pytest.mark.parametrize("rows", [1, 2, 16])
def test_a_projection_fused_from_parts_of_different_types_is_one_k8_layer(gguf_kernel, rows) -> None:
    parts = [gguf_kquants.decode("Q4_K", _random_file_blocks("Q4_K", 64, 512, 1)),
             gguf_kquants.decode("Q6_K", _random_file_blocks("Q6_K", 16, 512, 2)),
             _random_blocks("Q8_0", 16, 512, 3), _random_blocks("Q4_0", 8, 512, 4), _random_blocks("Q4_1", 8, 512, 5)]
    fused = Blocks.cat(parts)
    assert fused.kind == "K8" and torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    _check(fused, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 5, 37])
@pytest.mark.parametrize("shape", [(40, 96), (576, 576), (3, 1536), (80, 64)])
def test_dense_tiles_equal_a_float64_matmul_over_the_weights_as_they_load(gguf_kernel, dtype, rows, shape) -> None:
    g = torch.Generator().manual_seed(rows)
    out, inputs = shape
    weight = (torch.randn(out, inputs, generator=g) * 0.05).to(dtype)  # the checkpoint's values, not widened
    x = torch.randn(rows, inputs, generator=g)
    bias = torch.randn(out, generator=g)
    residual = torch.randn(rows, out, generator=g)
    exact = x.double() @ weight.double().t() + bias.double()
    size = x.double().abs() @ weight.double().abs().t() + bias.double().abs() + 1e-30
    layer = BlockLinear.of_dense(weight, bias)
    assert layer.kind == {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    assert ((layer(x).double() - exact).abs() / size).max().item() <= FLOAT32_ROUNDING
    assert ((layer.add_to(residual, x).double() - residual.double() - exact).abs() / size).max().item() \
        <= FLOAT32_ROUNDING
    again = BlockLinear.from_tensors(layer.tensors(), bias)
    assert torch.equal(again(x), layer(x))


def test_dense_tiles_refuse_what_the_kernel_cannot_read() -> None:
    assert not dense_packable(torch.zeros(16, 48))  # inputs not whole blocks of 32
    assert not dense_packable(torch.zeros(16, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="no kernel for a"):
        pack_dense(torch.zeros(16, 40))


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight",
                                  "model.embed_tokens.weight"])
@pytest.mark.parametrize("rows", [1, 16])
def test_the_kernel_on_the_default_models_blocks(gguf_kernel, blocks, name, rows) -> None:
    _check(blocks[name], rows)


def test_zero_rows_and_strided_inputs(gguf_kernel) -> None:
    b = _random_blocks("Q4_1", 48, 64, seed=3)
    layer = BlockLinear.of(b, None)
    assert layer(torch.empty(0, 64)).shape == (0, 48)
    wide = torch.randn(4, 128)
    assert torch.equal(layer(wide[:, ::2]), layer(wide[:, ::2].contiguous()))


def test_bad_inputs_get_a_clear_error(gguf_kernel) -> None:
    layer = BlockLinear.of(_random_blocks("Q4_0", 32, 64, seed=4), None)
    with pytest.raises(RuntimeError, match="inputs"):
        layer(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="float32"):
        layer(torch.randn(2, 64).double())
    b = _random_blocks("Q4_0", 16, 32, seed=5)
    with pytest.raises(ValueError, match="float16"):
        pack(Blocks("Q4_0", b.q, b.scale * (1 + 2**-20), None))


def test_a_packed_layer_round_trips_through_its_tensors(gguf_kernel) -> None:
    b = _random_blocks("Q8_0", 20, 64, seed=6)
    layer = BlockLinear.of(b, None)
    again = BlockLinear.from_tensors(layer.tensors(), None)
    x = torch.randn(3, 64)
    assert again.kind == "Q8_0" and again.out_features == 20 and torch.equal(again(x), layer(x))


@pytest.mark.parametrize("cxx, cpu_flags, reason", [
    ("no-such-compiler-here", None, "no-such-compiler-here"),
    (None, "flags : fpu sse4_2 avx f16c", "neither AVX-512 nor AVX2"),
    (None, "flags : fpu sse4_2 avx avx2 f16c", "neither AVX-512 nor AVX2"),  # AVX2 without FMA
])
def test_no_compiler_or_no_vector_unit_means_no_kernel_and_a_logged_reason(tmp_path, cxx, cpu_flags, reason) -> None:
    """In a fresh process with no compiler to be found, or on a CPU with neither AVX-512 nor AVX2 (with FMA and
    F16C): load() says False and logs why, and builds nothing."""
    fake = f"kernel_build._cpu_flags = lambda: {cpu_flags!r}; " if cpu_flags else ""
    code = ("import pathlib, sys; from services.worker import kernel_build; " + fake +
            f"sys.exit(0 if kernel_build.load(pathlib.Path({str(tmp_path)!r})) else 3)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"CXX": cxx} if cxx else {})}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    logged = [json.loads(line) if line.startswith("{") else line for line in (done.stdout + done.stderr).splitlines()]
    assert any("worker.kernel_unavailable" in str(e) and reason in str(e) for e in logged), logged
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").glob("*.so"))


def test_workers_starting_together_compile_the_kernel_once(tmp_path, monkeypatch) -> None:
    """Two workers on one cache (containers sharing a volume) that find no library: one compiles it, the other
    waits for the cache's build lock and then finds it built (both compiled it, each for a minute, on a loaded
    machine)."""
    from services.worker import kernel_build

    compiled: list[Path] = []

    def slow_compile(compiler: str, target: Path) -> None:
        compiled.append(target)
        time.sleep(0.3)
        target.write_bytes(b"library")

    monkeypatch.setattr(kernel_build, "_compile", slow_compile)
    path = tmp_path / "kernels" / "gguf_kernel-0123456789abcdef.so"
    (tmp_path / "kernels").mkdir()
    stale = tmp_path / "kernels" / "gguf_kernel-fedcba9876543210.so"
    stale.write_bytes(b"old")
    workers = [threading.Thread(target=kernel_build._build_once, args=("g++", path)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert compiled == [path] and path.read_bytes() == b"library" and not stale.exists()
