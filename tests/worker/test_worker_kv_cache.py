"""Block allocation and KV pool sizing."""

from __future__ import annotations

import pytest
import torch

from common.blocks import domain_root, prefix_keys
from services.worker.kv_cache import (
    ROOT_HASH,
    NULL_BLOCK,
    BlockAllocator,
    BlockTables,
    PagedKVCache,
    PoolExhausted,
    block_hash,
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


def test_cpu_plan_is_capped_by_cpu_max_bytes() -> None:
    cpu = torch.device("cpu")
    # 64 sequences of 2048 tokens at 1 KiB a token would take 128 MiB; 16 MiB holds 1024 blocks of 16 tokens
    assert plan_num_blocks(max_batch_size=64, max_model_len=2048, token_bytes=1024, device=cpu,
                           cpu_max_bytes=16 << 20) == 1024 + 1
    with pytest.raises(RuntimeError, match="not enough memory"):  # not even one full-length sequence
        plan_num_blocks(max_batch_size=1, max_model_len=2048, token_bytes=1024, device=cpu, cpu_max_bytes=1 << 20)


def _tables(num_blocks: int = 9) -> BlockTables:
    return BlockTables(num_blocks=num_blocks, block_size=4)


def _feed(tables: BlockTables, seq_id: int, prefix: list[int], feed: list[int], sample: bool = True) -> int:
    """What the engine does for one SeqStep's tokens; returns the position compute starts at."""
    end = len(prefix) + len(feed)
    first = tables.match_prefix(seq_id, prefix, feed, end - (1 if sample else 0))
    tables.prepare_write(seq_id, first)
    tables.reserve(seq_id, end)
    tables.commit(seq_id, prefix + feed)
    return first


def test_full_blocks_are_reused_by_hash_chain_and_partial_blocks_never() -> None:
    tables = _tables(num_blocks=16)
    a = list(range(1, 11))  # 10 tokens: 2 full blocks of 4 and a partial one
    assert _feed(tables, 1, [], a) == 0
    assert len(tables.allocator._by_hash) == 2
    # Same first block, different second: only the first is reused.
    b = a[:4] + [99, 98, 97, 96, 95]
    assert _feed(tables, 2, [], b) == 4
    assert tables.seqs[2][0] == tables.seqs[1][0] and tables.seqs[2][1] != tables.seqs[1][1]
    assert tables.allocator.refcount(tables.seqs[1][0]) == 2
    # The same tokens: both full blocks reused (the partial third is computed), sampling or not.
    assert _feed(tables, 3, [], a) == 8
    assert tables.seqs[3][:2] == tables.seqs[1][:2] and tables.seqs[3][2] != tables.seqs[1][2]
    # A chunk that ends on a cached block boundary without sampling computes nothing.
    assert _feed(tables, 4, [], a[:8], sample=False) == 8
    # A block equal in tokens but behind a different parent is not reused.
    assert _feed(tables, 5, [], [50, 51, 52, 53] + a[4:8], sample=False) == 0
    # Continuing a partial block: the cached full block replaces it.
    assert _feed(tables, 6, [], a[:2], sample=False) == 0
    empty = tables.allocator.num_empty
    assert _feed(tables, 6, a[:2], a[2:9], sample=True) == 8
    # Its old partial block went back to the free list and was taken again for the third block.
    assert tables.seqs[6][:2] == tables.seqs[1][:2] and tables.allocator.num_empty == empty
    assert tables.hit_tokens == 4 + 8 + 8 + 6


def test_released_full_blocks_stay_cached_and_evict_least_recently_used_first() -> None:
    tables = _tables(num_blocks=7)  # 6 usable blocks of 4 tokens
    a, b = list(range(1, 9)), list(range(101, 109))  # 2 full blocks each
    _feed(tables, 1, [], a)
    _feed(tables, 2, [], b)
    tables.release(1)
    tables.release(2)
    assert tables.allocator.num_cached == 4 and tables.allocator.num_empty == 2
    assert tables.free_tokens == tables.capacity_tokens
    tables.reserve(3, 4 * 4)  # 4 blocks: the 2 empty ones, then a's two (released first)
    first_a = block_hash(ROOT_HASH, a[:4])
    assert tables.allocator.lookup(first_a) is None
    assert tables.allocator.lookup(block_hash(ROOT_HASH, b[:4])) is not None
    assert tables.allocator.evictions == 2
    tables.release(3)
    assert _feed(tables, 4, [], b + [7]) == 8  # b survived
    tables.release(4)
    cached = tables.allocator.num_cached
    assert cached > 0 and tables.allocator.drop_cached() == cached
    assert tables.allocator.num_cached == 0 and tables.allocator.num_empty == 6
    assert _feed(tables, 5, [], b + [7]) == 0


def test_fork_shares_blocks_and_copies_the_partial_tail_on_write() -> None:
    tables = _tables()
    tokens = list(range(1, 7))  # a full block and a half
    _feed(tables, 1, [], tokens)
    tables.fork(1, 2)
    full, tail = tables.seqs[1]
    assert tables.seqs[2] == [full, tail] and tables.allocator.refcount(tail) == 2
    tables.prepare_write(2, 6)  # the fork writes first: it gets a copy
    assert tables.seqs[2][1] != tail and tables.take_copies() == [(tail, tables.seqs[2][1])]
    tables.prepare_write(1, 6)  # now the parent alone holds its tail: written in place
    assert tables.seqs[1][1] == tail and tables.copies == []
    assert tables.allocator.refcount(full) == 2


def test_truncate_drops_blocks_and_unnames_or_copies_a_kept_block_before_writing() -> None:
    tables = _tables()
    tokens = list(range(1, 10))  # 2 full blocks + 1
    _feed(tables, 1, [], tokens)
    b0, b1, b2 = tables.seqs[1]
    tables.truncate(1, 6)
    assert tables.seqs[1] == [b0, b1] and tables.allocator.refcount(b2) == 0 and len(tables.hashes[1]) == 1
    assert tables.allocator.hash_of(b1) is not None  # still named until written
    tables.prepare_write(1, 6)
    assert tables.allocator.hash_of(b1) is None and tables.seqs[1] == [b0, b1]
    # Shared: a fork's truncated block is copied first.
    tables.fork(1, 2)
    tables.truncate(2, 5)
    tables.prepare_write(2, 5)
    assert tables.seqs[2][0] == b0 and tables.seqs[2][1] != b1 and tables.take_copies() == [(b1, tables.seqs[2][1])]
    tables.truncate(2, 0)
    assert tables.seqs[2] == [] and tables.allocator.refcount(b0) == 1


def test_blocks_are_shared_only_within_a_cache_domain() -> None:
    tables = _tables(num_blocks=16)
    a = list(range(1, 10))  # 2 full blocks of 4
    tables.set_domain(1, "alice")
    assert _feed(tables, 1, [], a) == 0
    tables.set_domain(2, "bob")
    assert _feed(tables, 2, [], a) == 0  # the same tokens in another domain: computed again
    assert _feed(tables, 3, [], a) == 0  # nor does the shared domain find either
    tables.set_domain(4, "alice")
    assert _feed(tables, 4, [], a) == 8  # the same domain does
    tables.fork(4, 5)  # a fork stays in its parent's domain
    tables.truncate(5, 4)
    assert _feed(tables, 5, a[:4], a[4:]) == 8
    named = [tables.allocator.hash_of(b) for b in tables.seqs[1][:2]]
    assert named[0] == block_hash(domain_root("alice"), a[:4])  # the chain the scheduler's index computes
    assert [int.from_bytes(h[:8], "little", signed=True) for h in named] == list(
        prefix_keys(a, 4, root=domain_root("alice")))


def test_a_sealed_sequence_names_no_more_blocks_and_its_forks_neither() -> None:
    """A sequence whose steering changed mid-way (docs/steering.md): the blocks it fills from then on hold KV that
    its chain's names do not describe, so none is registered for another sequence to take."""
    tables = _tables(num_blocks=16)
    a = list(range(1, 14))  # 3 full blocks of 4
    assert _feed(tables, 1, [], a[:5]) == 0  # one full block named
    tables.seal(1)
    tables.fork(1, 2)
    assert _feed(tables, 1, a[:5], a[5:]) == 5
    assert len(tables.allocator._by_hash) == 1
    assert _feed(tables, 2, a[:4], a[4:12], sample=False) == 4  # nor does a sealed one look any up
    assert _feed(tables, 3, [], a) == 4  # only the block named before the seal is found
    tables.release(1)
    assert 1 not in tables.sealed and 2 in tables.sealed
