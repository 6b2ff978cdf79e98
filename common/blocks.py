"""Names of KV blocks, shared by the worker (its prefix cache) and the scheduler (its index of
which worker caches which prompt prefix).

A full block of ``block_size`` tokens is named by a hash chain: the hash of its parent block's
name and its own token ids, so equal names mean equal token prefixes. Workers report the names
they register and forget as 64-bit keys (the first 8 bytes of the name), which is all the
scheduler's placement needs: a collision only misplaces a request, it never changes its output.

Cache domains (docs/tenants.md): a sequence's chain starts from its domain's root (:func:`domain_root`)
instead of ``ROOT_HASH``, so blocks of equal tokens in two domains have different names: the KV one domain
computed is never found by another, on a worker or in the scheduler's index. The default domain ("") keeps
``ROOT_HASH``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

BLOCK_SIZE = 16  # tokens per block
ROOT_HASH = b""  # the parent name of a sequence's first block


def domain_root(domain: str) -> bytes:
    """The parent name of the first block of a sequence in cache domain ``domain`` (``Submit.cache_domain``)."""
    if not domain:
        return ROOT_HASH
    return hashlib.blake2b(b"tiller-cache-domain\0" + domain.encode(), digest_size=16).digest()


def whole_blocks(tokens: int) -> int:
    """``tokens`` rounded up to whole blocks: the KV a sequence of that many tokens takes, since a worker
    gives each sequence blocks of its own (its last one partly empty). The scheduler reserves KV so."""
    return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: a 128-bit BLAKE2b digest of its parent's name and its token ids."""
    return _name(parent, array("q", tokens).tobytes())


def _name(parent: bytes, data: bytes | memoryview) -> bytes:
    """A block's name from its parent's and its token ids as int64 bytes."""
    return hashlib.blake2b(parent + data, digest_size=16).digest()


def block_key(name: bytes) -> int:
    """The 64-bit key of a block name, as block events carry it."""
    return int.from_bytes(name[:8], "little", signed=True)


def prefix_keys(tokens: Sequence[int], block_size: int = BLOCK_SIZE, limit: int | None = None,
                root: bytes = ROOT_HASH) -> Iterator[int]:
    """The keys of the full blocks of ``tokens`` chained from ``root`` (a domain's), first block first (at most
    ``limit`` of them)."""
    parent = root
    blocks = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    data = memoryview(array("q", tokens[: blocks * block_size]).tobytes())  # block_hash's bytes, made once
    size = block_size * 8  # bytes per block (int64 tokens)
    for j in range(blocks):
        parent = _name(parent, data[j * size : (j + 1) * size])
        yield block_key(parent)
