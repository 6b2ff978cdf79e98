"""Block allocation and KV pool sizing."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv_cache import (
    NULL_BLOCK,
    BlockAllocator,
    BlockTables,
    PagedKVCache,
    PoolExhausted,
    plan_num_blocks,
)


def test_allocator_never_hands_out_the_null_block_and_counts_references() -> None:
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(3)
    assert NULL_BLOCK not in blocks and allocator.num_free == 0
    with pytest.raises(PoolExhausted):
        allocator.allocate(1)
    allocator.incref(blocks[:1])
    allocator.release(blocks)
    assert allocator.num_free == 2  # the shared block is still referenced
    allocator.release(blocks[:1])
    assert allocator.num_free == 3


def test_reserve_is_all_or_nothing_and_release_returns_blocks() -> None:
    tables = BlockTables(num_blocks=4, block_size=16)  # 3 usable blocks
    tables.reserve(1, 20)
    assert len(tables.seqs[1]) == 2
    tables.reserve(1, 32)  # still fits in two blocks
    assert len(tables.seqs[1]) == 2
    with pytest.raises(PoolExhausted):
        tables.reserve(2, 40)
    assert 2 not in tables.seqs and tables.allocator.num_free == 1
    b0, b1 = tables.seqs[1]
    assert tables.slots(1, 14, 18) == [b0 * 16 + 14, b0 * 16 + 15, b1 * 16, b1 * 16 + 1]
    tables.release(1)
    assert tables.free_tokens == tables.capacity_tokens == 48


def test_pool_null_block_is_zero_and_fresh_blocks_are_zeroed() -> None:
    cache = PagedKVCache(
        num_layers=2, num_kv_heads=1, head_dim=4, num_blocks=3, dtype=torch.float32, device=torch.device("cpu")
    )
    assert not cache.blocks[:, NULL_BLOCK].any()
    cache.blocks.fill_(float("nan"))
    cache.zero_blocks([2])
    assert not cache.blocks[:, 2].any() and cache.blocks[:, 1].isnan().all()


def test_plan_covers_the_batch_or_fails_clearly() -> None:
    cpu = torch.device("cpu")
    assert plan_num_blocks(max_batch_size=2, max_model_len=100, token_bytes=1024, device=cpu) == 2 * 7 + 1
    with pytest.raises(RuntimeError, match="not enough memory"):
        plan_num_blocks(max_batch_size=1, max_model_len=1 << 20, token_bytes=1 << 30, device=cpu)
