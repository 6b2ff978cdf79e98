"""The paged KV cache: fixed-size blocks handed out from a free list, per-sequence block tables.

Block 0 is the *null block*: never handed out and kept zeroed, so padded gathers (a short
sequence in a batch of longer ones) read finite zeros instead of uninitialised memory, which
could hold NaNs that survive a zero attention weight. Other blocks are zeroed on first use.
Blocks carry reference counts so that forks and shared prefixes can point several tables at one
block later without copying.
"""

from __future__ import annotations

import psutil
import torch

BLOCK_SIZE = 16  # tokens per block
NULL_BLOCK = 0
# Share of the memory left after loading the model that the pool may take.
KV_MEMORY_FRACTION_CPU = 0.5
KV_MEMORY_FRACTION_CUDA = 0.85


class PoolExhausted(Exception):
    """Not enough free blocks for a request; nothing was allocated."""


class BlockAllocator:
    """A free list of block ids with reference counts. Block 0 is reserved (the null block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (one is the reserved null block)")
        self.num_blocks = num_blocks
        # Pop from the end: low block ids go first, which keeps a lightly used pool compact.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)


class BlockTables:
    """Block tables of every live sequence over one allocator (accounting only, no tensors)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.seqs: dict[int, list[int]] = {}  # seq id -> its blocks, in position order

    @property
    def capacity_tokens(self) -> int:
        return (self.allocator.num_blocks - 1) * self.block_size

    @property
    def free_tokens(self) -> int:
        return self.allocator.num_free * self.block_size

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Grow ``seq_id``'s table (created if new) to hold ``num_tokens`` tokens.

        Raises PoolExhausted, allocating nothing, when the free list is too short.
        """
        blocks = self.seqs.get(seq_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks = blocks + self.allocator.allocate(need)
        self.seqs[seq_id] = blocks

    def release(self, seq_id: int) -> None:
        blocks = self.seqs.pop(seq_id, None)
        if blocks is not None:
            self.allocator.release(blocks)

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat slot indices (block * block_size + offset) of positions [start, end)."""
        blocks, bs = self.seqs[seq_id], self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


class PagedKVCache:
    """One preallocated pool per layer, shaped ``[num_blocks * block_size, 2 * kv_heads, head_dim]``:
    a flat slot axis so that writes and gathers are one index op, and each slot's keys (first
    ``kv_heads`` rows) beside its values, so one op moves both. Plus the block tables."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.tables = BlockTables(num_blocks, block_size)
        # empty, not zeros: on the CPU untouched pages then cost no memory until a block is used.
        shape = (num_layers, num_blocks * block_size, 2 * num_kv_heads, head_dim)
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        self.blocks = self.kv.view(num_layers, num_blocks, block_size, 2 * num_kv_heads, head_dim)
        self.blocks[:, NULL_BLOCK].zero_()
        self.layer_slots = list(self.kv.unbind(0))  # per layer, by slot: where a step writes
        self.layer_blocks = list(self.blocks.unbind(0))  # per layer, by block: what attention gathers

    def zero_blocks(self, blocks: list[int]) -> None:
        """Clear blocks on first use (in every layer): slots past a sequence's end are masked out
        of attention but still multiplied by a zero weight, so they must hold finite numbers."""
        index = torch.tensor(blocks, device=self.kv.device)
        for layer in self.layer_blocks:  # per layer: one strided fill across layers is ~100x slower
            layer.index_fill_(0, index, 0)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def plan_num_blocks(
    *,
    max_batch_size: int,
    max_model_len: int,
    token_bytes: int,
    device: torch.device,
    block_size: int = BLOCK_SIZE,
) -> int:
    """Blocks for ``max_batch_size`` sequences of ``max_model_len`` tokens, capped by free memory.

    Raises RuntimeError when memory cannot hold even one sequence of ``max_model_len`` tokens.
    """
    wanted = max_batch_size * -(-max_model_len // block_size)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] * KV_MEMORY_FRACTION_CUDA
    else:
        free = psutil.virtual_memory().available * KV_MEMORY_FRACTION_CPU
    affordable = int(free // (token_bytes * block_size))
    minimum = -(-max_model_len // block_size)
    if affordable < minimum:
        raise RuntimeError(
            f"not enough memory for the KV cache: one {max_model_len}-token sequence needs "
            f"{minimum * block_size * token_bytes / 2**20:.0f} MiB, {free / 2**20:.0f} MiB available"
        )
    return min(wanted, affordable) + 1  # + the null block
