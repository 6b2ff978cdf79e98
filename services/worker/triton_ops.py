"""The decoder-layer ops of :mod:`services.worker.fused_ops` as Triton kernels, for the GPU.

A decode step of a small model on a GPU is hundreds of tiny kernels; even replayed from a CUDA graph,
each costs a few microseconds. torch's ops take some fifteen kernels per layer around the matmuls
(the norm, the rotation in three, the KV write, the key gather, the masked attention, the
activation in two); these take five:

* ``rms_norm(x, w, eps)`` and ``silu_mul(gate_up)``, one kernel each;
* ``rope_store(qkv, cos, sin, positions, rotated, pool, slots)``: the rotation of the query and key
  heads in place and the copy of each row's keys and values to its slot, one kernel;
* ``decode_attention(q, blocks, tables, lengths, scale)``: paged attention that reads each sequence's
  keys and values from the pool's blocks in place (no gather, no mask), one program per sequence and
  KV head computing its whole query-head group with an online softmax. At batch 256 the gather
  copied every sequence's keys and values once more per layer; here they are read once.

Arithmetic is float32 inside the kernels (the attention's products on tensor cores in TF32 for
16-bit tensors, whose values TF32 holds exactly, and in full float32 for float32 ones); results
round to the tensors' dtype (bfloat16 when serving), so they differ from torch's ops in the last
bits. With ``TRITON_INTERPRET=1`` set before Triton is imported they run on CPU tensors in
Triton's interpreter: that is how the tests check them without a GPU (``tests/conftest.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.fused_ops import FusedOps

TILE = 64  # keys per iteration of decode_attention
MIN_DOT = 16  # tl.dot's smallest side: a query-head group is padded to it


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _silu_mul_kernel(g_ptr, g_stride, y_ptr, m, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < m
    gate = tl.load(g_ptr + row * g_stride + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(g_ptr + row * g_stride + m + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * m + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, pool_ptr, slot_ptr,
                       ALL: tl.constexpr, ROTATED: tl.constexpr, FIRST: tl.constexpr, DIM: tl.constexpr,
                       HEADS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, DIM)[None, :]
    pos = tl.load(pos_ptr + token)
    row = qkv_ptr + token * ALL * DIM
    inside = head < ALL
    x = tl.load(row + head * DIM + d, mask=inside, other=0.0).to(tl.float32)
    rolled = tl.load(row + head * DIM + (d + DIM // 2) % DIM, mask=inside, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * DIM + d).to(tl.float32)
    s = tl.load(sin_ptr + pos * DIM + d).to(tl.float32)
    rotated = head < ROTATED
    y = tl.where(rotated, x * c + rolled * s, x).to(qkv_ptr.dtype.element_ty)
    tl.store(row + head * DIM + d, y, mask=rotated)
    slot = tl.load(slot_ptr + token)
    tl.store(pool_ptr + slot * (ALL - FIRST) * DIM + (head - FIRST) * DIM + d, y, mask=inside & (head >= FIRST))


@triton.jit
def _decode_attention_kernel(q_ptr, q_stride, kv_ptr, table_ptr, table_stride, len_ptr, out_ptr, scale,
                             HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                             BLOCK_G: tl.constexpr, DIM: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                             PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, DIM)
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    q = tl.load(q_ptr + seq * q_stride + heads[:, None] * DIM + d[None, :], mask=in_group[:, None], other=0.0)
    q = q.to(tl.float32)
    length = tl.load(len_ptr + seq)
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, DIM], tl.float32)
    start = length * 0
    while start < length:  # (a while loop: Triton's interpreter cannot take a loaded bound in range())
        key = start + tl.arange(0, TILE)
        valid = key < length
        block = tl.load(table_ptr + seq * table_stride + key // BS, mask=valid, other=0)
        slot = (block * BS + key % BS).to(tl.int64) * (2 * KV_HEADS * DIM)
        k = tl.load(kv_ptr + slot[:, None] + kv_head * DIM + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(kv_ptr + slot[:, None] + (KV_HEADS + kv_head) * DIM + d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        top = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp(scores - top[:, None])
        fade = tl.exp(best - top)
        total = total * fade + tl.sum(weights, 1)
        acc = acc * fade[:, None] + tl.dot(weights, v.to(tl.float32), input_precision=PRECISION)
        best = top
        start += TILE
    out = acc / total[:, None]
    tl.store(out_ptr + seq * HEADS * DIM + heads[:, None] * DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=in_group[:, None])


def _rows(t: torch.Tensor, what: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{what} must be [rows, n] with unit stride along n, got {tuple(t.shape)}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` by row."""
    _rows(x, "x")
    rows, n = x.shape
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, x.stride(0), w, y, n, eps, BLOCK=triton.next_power_of_2(n))
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate|up projection ``[rows, 2 m]``."""
    _rows(gate_up, "gate_up")
    rows, m = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, m, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(m))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(m, block))](gate_up, gate_up.stride(0), y, m, BLOCK=block)
    return y


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, rotated: int,
               pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotates the first ``rotated`` heads of ``qkv [tokens, heads, dim]`` in place (``x * cos +
    roll(x, dim / 2) * sin`` at each token's position, the tables as
    :class:`services.worker.layers.attention.Rotary` lays them out) and copies each token's last
    ``pool.shape[1]`` heads (its keys, rotated, and values) to its slot of ``pool [slots, 2 kv_heads, dim]``."""
    tokens, heads, dim = qkv.shape
    if not qkv.is_contiguous() or not pool.is_contiguous() or pool.shape[2] != dim:
        raise ValueError("qkv and pool must be contiguous [.., heads, dim] with the same dim")
    if tokens:
        _rope_store_kernel[(tokens,)](qkv, cos, sin, positions, pool, slots, ALL=heads, ROTATED=rotated,
                                      FIRST=heads - pool.shape[1], DIM=dim, HEADS=triton.next_power_of_2(heads))


def decode_attention(q: torch.Tensor, blocks: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one query row per sequence, ``q [n, heads, dim]`` (heads side by side), over its
    first ``lengths[i]`` keys and values read in place from ``blocks [num_blocks, block_size,
    2 kv_heads, dim]`` (keys, then values) through its row of ``tables [n, width]``. Grouped-query:
    query head h reads KV head h / (heads / kv_heads). Returns ``[n, heads * dim]``."""
    n, heads, dim = q.shape
    _, block_size, both, _ = blocks.shape
    kv_heads = both // 2
    if q.stride(2) != 1 or q.stride(1) != dim or not blocks.is_contiguous() or heads % kv_heads:
        raise ValueError("q must be [n, heads, dim] with heads side by side, blocks contiguous, heads a multiple "
                         "of the KV heads")
    out = torch.empty(n, heads * dim, dtype=q.dtype, device=q.device)
    if n:
        group = heads // kv_heads
        _decode_attention_kernel[(n, kv_heads)](
            q, q.stride(0), blocks, tables, tables.stride(0), lengths, out, scale, HEADS=heads, KV_HEADS=kv_heads,
            GROUP=group, BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), DIM=dim, BS=block_size, TILE=TILE,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out


def load(kv: torch.Tensor, head_dim: int, hidden_act: str) -> FusedOps | None:
    """The ops, where they apply: head_dim a power of two from 16 to 256 (the kernels' tiles), a
    SiLU-gated MLP. None: use torch's ops."""
    if head_dim & (head_dim - 1) or not MIN_DOT <= head_dim <= 256 or hidden_act != "silu":
        return None
    return FusedOps(rms_norm=rms_norm, silu_mul=silu_mul, rope_store=rope_store, decode_attention=decode_attention,
                    decode_layer=None)
