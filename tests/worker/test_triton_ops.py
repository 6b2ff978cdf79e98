"""Tiller's Triton kernels against torch's ops on the same tensors.

On a machine without a GPU they run in Triton's interpreter (``tests/conftest.py`` turns it on),
and are also compiled, without running, for an A100's and an H100's instruction sets (Triton
bundles NVIDIA's assembler), which the interpreter does not check; on a GPU they are compiled and
run there. Shapes are the default model's (9 query heads on 3 KV
heads, head_dim 64) and Llama-1B's groups (32 on 8), with 16-token blocks landing out of order in
the pool, contexts of one key up to several of the attention's 64-key tiles, and tables padded
with the null block; float32 to float32's rounding, bfloat16 to its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from services.worker import triton_ops
from services.worker.engine import layer_kernels
from services.worker.kv_cache import NULL_BLOCK

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS = 16
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def test_rms_norm_and_silu_mul(dtype: torch.dtype) -> None:
    x, w = _randn(5, 576, dtype=dtype, seed=1), _randn(576, dtype=dtype, seed=2)
    ref = torch.rms_norm(x.float(), (576,), w.float(), 1e-5)
    torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5).float(), ref, **TOLERANCE[dtype])
    gate_up = _randn(4, 2 * 1536, dtype=dtype, seed=3)
    gate, up = gate_up.float().view(4, 2, 1536).unbind(1)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up).float(), F.silu(gate) * up, **TOLERANCE[dtype])
    assert triton_ops.rms_norm(x[:0], w, 1e-5).shape == (0, 576)


def test_rope_store_rotates_in_place_and_writes_the_slots(dtype: torch.dtype) -> None:
    heads, kv_heads, dim = 9, 3, 64
    qkv = _randn(6, heads + 2 * kv_heads, dim, dtype=dtype, seed=4)
    cos, sin = _randn(100, dim, dtype=dtype, seed=5), _randn(100, dim, dtype=dtype, seed=6)
    positions = torch.tensor([0, 5, 17, 33, 99, 2], device=DEVICE)
    slots = torch.tensor([3, 70, 100, 5, 639, 20], device=DEVICE)
    pool = torch.zeros(40 * BS, 2 * kv_heads, dim, dtype=dtype, device=DEVICE)
    ref = qkv.float().clone()
    rotated = ref[:, : heads + kv_heads]
    ref[:, : heads + kv_heads] = (rotated * cos[positions].float()[:, None]
                                  + rotated.roll(dim // 2, -1) * sin[positions].float()[:, None])
    triton_ops.rope_store(qkv, cos, sin, positions, heads + kv_heads, pool, slots)
    torch.testing.assert_close(qkv.float(), ref, **TOLERANCE[dtype])
    torch.testing.assert_close(pool[slots].float(), ref[:, heads:], **TOLERANCE[dtype])
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not pool[untouched].any()


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8)])
def test_decode_attention_reads_the_blocks_in_place(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    dim, num_blocks = 64, 40
    blocks = _randn(num_blocks, BS, 2 * kv_heads, dim, dtype=dtype, seed=7)
    lengths = torch.tensor([1, 17, 64, 150, 200], device=DEVICE)
    width = 16
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(8)) + 1
    tables = torch.full((5, width), NULL_BLOCK, dtype=torch.long)
    for i, length in enumerate(lengths.tolist()):
        used = -(-length // BS)
        tables[i, :used] = order[(i * 7) % 20 : (i * 7) % 20 + used]
    tables = tables.to(DEVICE)
    q = _randn(5, heads + 2 * kv_heads, dim, dtype=dtype, seed=9)[:, :heads]  # rows strided, as the forward's
    out = triton_ops.decode_attention(q, blocks, tables, lengths, dim**-0.5)
    assert out.shape == (5, heads * dim) and out.dtype == dtype
    for i, length in enumerate(lengths.tolist()):
        kv = blocks[tables[i]].reshape(-1, 2 * kv_heads, dim)[:length].float()
        k, v = kv[:, :kv_heads].transpose(0, 1), kv[:, kv_heads:].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v, enable_gqa=True)
        torch.testing.assert_close(out[i].float(), ref.reshape(-1), **TOLERANCE[dtype], msg=f"row {i}")


def test_shapes_the_kernels_cannot_take_are_left_to_torch() -> None:
    kv = torch.zeros(1, device=DEVICE)
    assert triton_ops.load(kv, 64, "silu") is not None
    assert triton_ops.load(kv, 80, "silu") is None  # not a power of two: the tiles cannot hold it
    assert triton_ops.load(kv, 64, "gelu") is None
    with pytest.raises(ValueError, match="heads side by side"):
        q = torch.zeros(2, 64, 9, device=DEVICE).transpose(1, 2)
        triton_ops.decode_attention(q, torch.zeros(4, BS, 6, 64, device=DEVICE),
                                    torch.zeros(2, 1, dtype=torch.long, device=DEVICE),
                                    torch.ones(2, dtype=torch.long, device=DEVICE), 0.125)


def test_the_engine_runs_them_only_on_a_gpu_and_when_asked() -> None:
    def model(device: str, kernel: bool = False) -> SimpleNamespace:
        return SimpleNamespace(kernel=kernel, device=torch.device(device))

    assert layer_kernels(model("cuda"), "triton") == "triton"
    assert layer_kernels(model("cuda"), "torch") == "torch"  # the default setting
    assert layer_kernels(model("cpu"), "triton") == "torch"  # a CPU has the kernel library's ops instead
    assert layer_kernels(model("cpu", kernel=True), "torch") == "library"


COMPILE_FOR_GPUS = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from services.worker import triton_ops as T

    def build(fn, signature, constants, capability):
        source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                           constexprs=constants)
        assert triton.compile(source, target=GPUTarget("cuda", capability, 32)).asm["cubin"]

    for capability in (80, 90):
        for dt in ("bf16", "fp32"):
            for heads, kv_heads, hidden, inter in ((9, 3, 576, 1536), (32, 8, 2048, 8192)):  # SmolLM2, Llama-1B
                group, every = heads // kv_heads, heads + 2 * kv_heads
                build(T._decode_attention_kernel,
                      {"q_ptr": f"*{dt}", "q_stride": "i32", "kv_ptr": f"*{dt}", "table_ptr": "*i64",
                       "table_stride": "i32", "len_ptr": "*i64", "out_ptr": f"*{dt}", "scale": "fp32"},
                      {"HEADS": heads, "KV_HEADS": kv_heads, "GROUP": group, "BLOCK_G": max(16, group),
                       "DIM": 64, "BS": 16, "TILE": T.TILE, "PRECISION": "ieee" if dt == "fp32" else "tf32"},
                      capability)
                build(T._rope_store_kernel,
                      {"qkv_ptr": f"*{dt}", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}", "pos_ptr": "*i64",
                       "pool_ptr": f"*{dt}", "slot_ptr": "*i64"},
                      {"ALL": every, "ROTATED": heads + kv_heads, "FIRST": heads, "DIM": 64,
                       "HEADS": triton.next_power_of_2(every)}, capability)
                build(T._rms_norm_kernel, {"x_ptr": f"*{dt}", "x_stride": "i32", "w_ptr": f"*{dt}",
                                           "y_ptr": f"*{dt}", "n": "i32", "eps": "fp32"},
                      {"BLOCK": triton.next_power_of_2(hidden)}, capability)
                build(T._silu_mul_kernel, {"g_ptr": f"*{dt}", "g_stride": "i32", "y_ptr": f"*{dt}", "m": "i32"},
                      {"BLOCK": min(1024, triton.next_power_of_2(inter))}, capability)
""")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a GPU compiles and runs them in the tests above")
def test_the_kernels_compile_for_nvidia_gpus(tmp_path) -> None:
    """The interpreter runs the kernels' Python; a GPU also needs them to compile (types carried through
    the loops, tile shapes ``tl.dot`` takes, NVIDIA's assembler): compiled here for sm_80 and sm_90, in
    bfloat16 and float32, at the default model's shapes and Llama-1B's, in a process of its own (this
    one runs Triton's interpreter) with an empty cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_GPUS], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
