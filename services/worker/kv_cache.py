"""The paged KV cache: fixed-size blocks with reference counts, per-sequence block tables, prefix
reuse, copy-on-write and eviction.

Block 0 is the *null block*: never handed out and kept zeroed, so padded gathers (a short
sequence in a batch of longer ones) read finite zeros instead of uninitialised memory, which
could hold NaNs that survive a zero attention weight. Other blocks are zeroed on first use.

Prefix reuse. A *full* block (``block_size`` computed tokens) is named by a hash chain: the hash
of its parent block's hash and its own token ids, so equal names mean equal token prefixes, hence
equal keys and values. Full blocks are registered under their name once computed; a sequence
fed tokens whose full blocks are registered (held by a live sequence, or unreferenced but not yet
evicted) references those blocks instead of computing them. A block being written (a sequence's
partial last block) is never registered.

Sharing. Forks and prefix hits point several tables at one block (its reference count says how
many). Only a sequence's partial last block is ever written, and :meth:`BlockTables.prepare_write`
copies it first when it is shared (copy-on-write); the copies are queued in
:attr:`BlockTables.copies` for the tensor pool to carry out before the next forward pass.

Eviction. A block whose count drops to zero goes back to the free list when it holds nothing
reusable, or to the *cached* list, least recently used first, when it is registered: it stays
reusable until an allocation finds the free list empty and takes the least recently used cached
block (its name is forgotten then). A sequence's blocks are released last block first, so of one
sequence the blocks deepest in the prefix (the least likely to be shared) go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import psutil
import torch

from common.blocks import BLOCK_SIZE, ROOT_HASH, block_hash, block_key, domain_root
from services.worker.transfer import to_device

NULL_BLOCK = 0
# Share of the memory left after loading the model that the pool may take.
KV_MEMORY_FRACTION_CPU = 0.5
KV_MEMORY_FRACTION_CUDA = 0.85


class PoolExhausted(Exception):
    """Not enough free blocks for a request; nothing was allocated."""


class BlockAllocator:
    """Block ids with reference counts, a free list, the registry of full blocks by hash and the LRU
    list of unreferenced registered blocks. Block 0 is reserved (the null block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (one is the reserved null block)")
        self.num_blocks = num_blocks
        # Pop from the end: low block ids go first, which keeps a lightly used pool compact.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, registered; first = LRU
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.evictions = 0
        # block key -> registered (True) or forgotten (False) since the last take_events(); the
        # scheduler's prefix index follows the registry through these
        self._events: dict[int, bool] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty ones plus cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_empty(self) -> int:
        """Unreferenced blocks holding nothing reusable."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a registered prefix block."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with count 1: empty blocks first, then the least recently used cached ones.

        Raises PoolExhausted, allocating nothing, when fewer than ``n`` can be had."""
        if n > self.num_free:
            raise PoolExhausted(f"need {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                self.unregister(b)
                self.evictions += 1
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        """One more reference each; an unreferenced cached block leaves the LRU list."""
        for b in blocks:
            if self._refs[b] == 0:
                if b not in self._cached:
                    raise ValueError(f"block {b} is free: allocate it instead")
                del self._cached[b]
            self._refs[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less each, in order; a block reaching zero becomes the most recently used
        cached block when registered, else free."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def drop_cached(self) -> int:
        """Forget every unreferenced cached block (they become free); returns how many."""
        dropped = len(self._cached)
        for b in self._cached:
            self.unregister(b)
            self._free.append(b)
        self._cached.clear()
        return dropped

    def lookup(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def register(self, block: int, h: bytes) -> None:
        """Name a full, referenced block (its contents must never change while it has the name)."""
        assert h not in self._by_hash and block not in self._hash_of and self._refs[block] > 0
        self._hash_of[block] = h
        self._by_hash[h] = block
        self._events[block_key(h)] = True

    def unregister(self, block: int) -> None:
        """Forget a block's name (before it is written again)."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._by_hash[h]
            self._events[block_key(h)] = False

    def take_events(self, everything: bool = False) -> tuple[list[int], list[int]]:
        """The keys of the blocks registered and forgotten since the last call (``everything``:
        every block registered now, none forgotten, for a scheduler that knows nothing yet)."""
        events, self._events = self._events, {}
        if everything:
            return [block_key(h) for h in self._by_hash], []
        return [k for k, new in events.items() if new], [k for k, new in events.items() if not new]


class BlockTables:
    """Block tables of every live sequence over one allocator (accounting only, no tensors).

    ``prefix_caching=False`` (the transformers fallback, whose caches are not paged) never names
    blocks, so nothing is shared across requests; forks still share in the accounting.
    """

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, *, prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.seqs: dict[int, list[int]] = {}  # seq id -> its blocks, in position order
        # seq id -> the names of its full blocks (len == its length // block_size, when caching)
        self.hashes: dict[int, list[bytes]] = {}
        self.roots: dict[int, bytes] = {}  # seq id -> its chain's root, when not ROOT_HASH (its cache domain's)
        # sequences whose later blocks are not named (their steering changed: docs/steering.md): what they compute
        # from then on is not what the chain of their domain says, so no other sequence may take it
        self.sealed: set[int] = set()
        self.copies: list[tuple[int, int]] = []  # (source, destination) block copies not yet done
        self.hit_tokens = 0  # tokens whose KV came from the cache (all lookups so far)

    @property
    def capacity_tokens(self) -> int:
        return (self.allocator.num_blocks - 1) * self.block_size

    @property
    def free_tokens(self) -> int:
        """Tokens allocations can still take (cached blocks count: they are evicted on demand)."""
        return self.allocator.num_free * self.block_size

    @property
    def empty_tokens(self) -> int:
        """Tokens of the unreferenced blocks that hold nothing reusable."""
        return self.allocator.num_empty * self.block_size

    @property
    def cached_tokens(self) -> int:
        """Tokens of the unreferenced blocks that still hold a reusable prefix (taken when empty ones run out)."""
        return self.allocator.num_cached * self.block_size

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Grow ``seq_id``'s table (created if new) to hold ``num_tokens`` tokens.

        Raises PoolExhausted, allocating nothing, when the free list is too short.
        """
        blocks = self.seqs.get(seq_id, [])
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks = blocks + self.allocator.allocate(need)
        self.seqs[seq_id] = blocks

    def set_domain(self, seq_id: int, domain: str) -> None:
        """A new sequence's cache domain: its blocks are named in that domain's chain (common.blocks)."""
        if domain:
            self.roots[seq_id] = domain_root(domain)

    def seal(self, seq_id: int) -> None:
        """Name none of ``seq_id``'s blocks from now on (those named so far stay: they hold what their names say)."""
        self.sealed.add(seq_id)

    def release(self, seq_id: int) -> None:
        blocks = self.seqs.pop(seq_id, None)
        self.hashes.pop(seq_id, None)
        self.roots.pop(seq_id, None)
        self.sealed.discard(seq_id)
        if blocks is not None:
            self.allocator.release(blocks[::-1])  # last block first: it is the first to evict

    def fork(self, parent: int, child: int) -> None:
        """``child`` (new) shares every block of ``parent``."""
        blocks = self.seqs.get(parent, [])
        self.allocator.incref(blocks)
        self.seqs[child] = list(blocks)
        self.hashes[child] = list(self.hashes.get(parent, []))
        if parent in self.roots:
            self.roots[child] = self.roots[parent]
        if parent in self.sealed:
            self.sealed.add(child)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens' blocks. A partially kept block stays as it is (shared or
        named) until :meth:`prepare_write` makes it writable, so a rollback that is never followed
        by a write costs no copy and keeps the block's name."""
        blocks = self.seqs.get(seq_id)
        if blocks is None:
            return
        keep = -(-length // self.block_size)
        self.allocator.release(blocks[keep:][::-1])
        del blocks[keep:]
        hashes = self.hashes.get(seq_id)
        if hashes is not None:
            del hashes[length // self.block_size :]

    def match_prefix(self, seq_id: int, prefix: list[int], feed: list[int], limit: int) -> int:
        """Point ``seq_id``'s table at registered blocks for the tokens ``feed`` adds after
        ``prefix`` (the sequence so far), as far as they form full blocks ending at or before
        position ``limit``. Returns the position from which tokens must still be computed
        (``len(prefix)`` on a miss). A partial last block of the sequence is replaced by the
        registered full block that extends it."""
        start = len(prefix)
        bs = self.block_size
        j = start // bs  # the first block that could come from the cache
        if not self.prefix_caching or (j + 1) * bs > limit or seq_id in self.sealed:
            return start
        blocks = self.seqs.setdefault(seq_id, [])
        hashes = self.hashes.setdefault(seq_id, [])
        assert len(hashes) == j and len(blocks) <= j + 1, "a sequence's full blocks are all named"
        history = prefix[j * bs :] + feed  # from the start of block j
        parent = hashes[-1] if hashes else self.roots.get(seq_id, ROOT_HASH)
        offset = 0
        while (j + 1) * bs <= limit:
            h = block_hash(parent, history[offset : offset + bs])
            block = self.allocator.lookup(h)
            if block is None:
                break
            self.allocator.incref([block])  # before releasing the old one: it may be the same block
            if j < len(blocks):
                self.allocator.release([blocks[j]])
                blocks[j] = block
            else:
                blocks.append(block)
            hashes.append(h)
            parent = h
            j += 1
            offset += bs
        end = max(start, j * bs)
        self.hit_tokens += end - start
        return end

    def prepare_write(self, seq_id: int, start: int) -> None:
        """Make the block holding position ``start`` writable when the sequence already has it (a
        partial last block): copied to a fresh block when shared, unnamed when only this sequence
        holds it. Raises PoolExhausted when a copy needs a block and none is free."""
        bs = self.block_size
        blocks = self.seqs.get(seq_id)
        if start % bs == 0 or blocks is None or len(blocks) <= start // bs:
            return
        j = start // bs
        tail = blocks[j]
        if self.allocator.refcount(tail) > 1:
            (copy,) = self.allocator.allocate(1)
            self.copies.append((tail, copy))
            self.allocator.release([tail])
            blocks[j] = copy
        else:
            self.allocator.unregister(tail)

    def commit(self, seq_id: int, tokens: list[int]) -> None:
        """After a forward pass: name the blocks ``tokens`` (the whole sequence) now fills. A block
        whose name is already registered to another block is swapped for that one (the two hold
        the same keys and values), so sequences that computed a prefix at once end up sharing it."""
        if not self.prefix_caching or seq_id in self.sealed:
            return
        bs = self.block_size
        blocks = self.seqs[seq_id]
        hashes = self.hashes.setdefault(seq_id, [])
        parent = hashes[-1] if hashes else self.roots.get(seq_id, ROOT_HASH)
        for j in range(len(hashes), len(tokens) // bs):
            h = block_hash(parent, tokens[j * bs : (j + 1) * bs])
            existing = self.allocator.lookup(h)
            if existing is None:
                self.allocator.register(blocks[j], h)
            elif existing != blocks[j]:
                self.allocator.incref([existing])
                self.allocator.release([blocks[j]])
                blocks[j] = existing
            hashes.append(h)
            parent = h

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
        index = to_device(blocks, self.kv.device)
        for layer in self.layer_blocks:  # per layer: one strided fill across layers is ~100x slower
            layer.index_fill_(0, index, 0)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Carry out copy-on-write copies ``(source, destination)``, in order, in every layer."""
        for src, dst in copies:
            self.blocks[:, dst].copy_(self.blocks[:, src])


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def plan_num_blocks(
    *,
    max_batch_size: int,
    max_model_len: int,
    token_bytes: int,
    device: torch.device,
    memory_fraction: float | None = None,
    cpu_max_bytes: int | None = None,
    block_size: int = BLOCK_SIZE,
) -> int:
    """Blocks for ``max_batch_size`` sequences of ``max_model_len`` tokens, capped by
    ``memory_fraction`` of the free memory (default: 0.85 of a GPU's, 0.5 of the CPU's available)
    and, on the CPU, by ``cpu_max_bytes``: the pool's pages become resident as blocks are first used
    and stay so, so a pool sized by free RAM alone grows the worker with traffic up to that size.

    Raises RuntimeError when memory cannot hold even one sequence of ``max_model_len`` tokens.
    """
    wanted = max_batch_size * -(-max_model_len // block_size)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] * (memory_fraction or KV_MEMORY_FRACTION_CUDA)
    else:
        free = psutil.virtual_memory().available * (memory_fraction or KV_MEMORY_FRACTION_CPU)
        if cpu_max_bytes is not None:
            free = min(free, cpu_max_bytes)
    affordable = int(free // (token_bytes * block_size))
    minimum = -(-max_model_len // block_size)
    if affordable < minimum:
        raise RuntimeError(
            f"not enough memory for the KV cache: one {max_model_len}-token sequence needs "
            f"{minimum * block_size * token_bytes / 2**20:.0f} MiB, {free / 2**20:.0f} MiB available"
        )
    return min(wanted, affordable) + 1  # + the null block
