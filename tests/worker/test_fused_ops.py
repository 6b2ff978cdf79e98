"""The kernel library's decoder-layer ops (services/worker/fused_ops.py) against torch's.

Each op must equal the torch ops the native forward runs otherwise, within float32 rounding: the
norm and the gated activation by row (strided rows too); the rotation and KV write over a whole
q|k|v projection; and the decode attention over keys and values read from paged blocks in place,
for a batch of rows of different lengths (one key, a whole block, many blocks in a shuffled
order), rows sharing blocks (forks), grouped-query heads. Bad inputs get a clear error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker import fused_ops
from services.worker.fused_ops import FusedOps

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 64, 16


@pytest.fixture(scope="module")
def ops(gguf_kernel) -> FusedOps:
    loaded = fused_ops.load(torch.empty(1, 2, DIM), DIM, "silu")
    assert loaded is not None
    return loaded


def test_what_the_ops_apply_to(gguf_kernel) -> None:
    assert fused_ops.load(torch.empty(1, 2, 64), 64, "silu") is not None
    assert fused_ops.load(torch.empty(1, 2, 64, dtype=torch.bfloat16), 64, "silu") is None
    assert fused_ops.load(torch.empty(1, 2, 72), 72, "silu") is None
    assert fused_ops.load(torch.empty(1, 2, 144), 144, "silu") is None
    assert fused_ops.load(torch.empty(1, 2, 64), 64, "gelu") is None


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("n", [576, 70])
def test_rms_norm_and_silu_mul_equal_torchs(ops, rows, n) -> None:
    g = torch.Generator().manual_seed(rows * n)
    wide = torch.randn(rows, 2 * n, generator=g) * 3
    w = torch.randn(n, generator=g)
    for x in (wide[:, :n], wide[:, :n].contiguous()):  # a strided row and a packed one
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), torch.rms_norm(x, (n,), w, 1e-5), rtol=1e-5, atol=1e-6)
    gate, up = wide.view(rows, 2, n).unbind(1)
    torch.testing.assert_close(ops.silu_mul(wide), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def _tables(positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[positions, DIM]`` laid out as the native forward's (sin's first half negated)."""
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(positions, DIM // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)
    return cos.contiguous(), sin.contiguous()


def test_rope_store_rotates_queries_and_keys_and_writes_the_pool(ops) -> None:
    tokens, all_heads = 5, HEADS + 2 * KV_HEADS
    cos, sin = _tables(50, 1)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, all_heads, DIM, generator=g)
    positions = torch.tensor([0, 7, 49, 3, 3])
    slots = torch.tensor([9, 2, 30, 31, 0])
    pool = torch.zeros(32, 2 * KV_HEADS, DIM)

    rotated = HEADS + KV_HEADS
    c = torch.cat([cos[positions].unsqueeze(1).expand(-1, rotated, -1), torch.ones(tokens, KV_HEADS, DIM)], 1)
    s = torch.cat([sin[positions].unsqueeze(1).expand(-1, rotated, -1), torch.zeros(tokens, KV_HEADS, DIM)], 1)
    want = torch.addcmul(qkv * c, qkv.roll(DIM // 2, -1), s)
    want_pool = pool.clone().index_copy_(0, slots, want[:, HEADS:])

    ops.rope_store(qkv, cos, sin, positions, rotated, pool, slots)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="outside the rotary tables"):
        ops.rope_store(qkv, cos, sin, torch.tensor([0, 1, 2, 3, 50]), rotated, pool, slots)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.rope_store(qkv, cos, sin, positions, rotated, pool, torch.tensor([0, 1, 2, 3, 32]))


def _reference(q: torch.Tensor, blocks: torch.Tensor, tables: list[list[int]], lengths: list[int]) -> torch.Tensor:
    """Each row's attention over its gathered keys and values, by torch's SDPA (float64)."""
    outs = []
    for i, (table, length) in enumerate(zip(tables, lengths)):
        kv = blocks[torch.tensor(table)].reshape(-1, 2 * KV_HEADS, DIM)[:length].double()
        k, v = kv[:, :KV_HEADS].transpose(0, 1), kv[:, KV_HEADS:].transpose(0, 1)
        out = F.scaled_dot_product_attention(q[i].double().unsqueeze(1), k, v, enable_gqa=True)
        outs.append(out.reshape(HEADS * DIM))
    return torch.stack(outs).float()


def test_decode_attention_reads_paged_blocks_in_place(ops) -> None:
    num_blocks = 24
    g = torch.Generator().manual_seed(3)
    blocks = torch.randn(num_blocks, BLOCK, 2 * KV_HEADS, DIM, generator=g)
    order = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()  # block 0 stays the (unused) null block
    lengths = [1, BLOCK, BLOCK + 1, 9 * BLOCK - 3, 40, 40]
    tables, at = [], 0
    for length in lengths[:-1]:
        need = -(-length // BLOCK)
        tables.append(order[at : at + need])
        at += need
    tables.append(tables[-1][:2] + [order[at]])  # a fork: the last row shares the one before's first two blocks
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(lengths), HEADS + 2 * KV_HEADS, DIM, generator=g)  # q as the forward slices it: strided
    q = qkv[:, :HEADS]
    got = ops.decode_attention(q, blocks, padded, torch.tensor(lengths), DIM**-0.5)
    torch.testing.assert_close(got, _reference(q, blocks, tables, lengths), rtol=1e-5, atol=2e-6)
    one = ops.decode_attention(q[3:4], blocks, padded[3:4], torch.tensor(lengths[3:4]), DIM**-0.5)
    torch.testing.assert_close(one, got[3:4], rtol=1e-6, atol=1e-7)  # a row's result does not depend on the batch


def test_decode_attention_rejects_bad_inputs(ops) -> None:
    blocks = torch.zeros(4, BLOCK, 2 * KV_HEADS, DIM)
    q = torch.zeros(1, HEADS, DIM)
    with pytest.raises(RuntimeError, match="keys, its table holds"):
        ops.decode_attention(q, blocks, torch.tensor([[1]]), torch.tensor([BLOCK + 1]), 1.0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.decode_attention(q, blocks, torch.tensor([[4]]), torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="heads"):
        ops.decode_attention(torch.zeros(1, 5, DIM), blocks, torch.tensor([[1]]), torch.tensor([3]), 1.0)
