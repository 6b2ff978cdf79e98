"""The gateway's cache of steering vectors' canonical content by id (docs/steering.md, "Vectors"): an id names one
content forever, so what the session store sent once is kept, least recently used out first, and a request naming
it again asks the store only who may use it (``VectorLookup.cached``), not for its bytes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.steering import decode

MAX_ENTRIES = 256  # (every lookup names the cached ids: a few KiB at most)
MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class CachedVector:
    content: bytes  # canonical (common.steering.encode)
    hidden_size: int
    layers: frozenset[int]


class VectorCache:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CachedVector] = OrderedDict()
        self._bytes = 0

    def snapshot(self) -> dict[str, CachedVector]:
        """The entries as they are now (a lookup uses these even if they are evicted while it waits)."""
        return dict(self._entries)

    def add(self, vector_id: str, content: bytes) -> CachedVector:
        """Keep ``content`` (SteeringError if it is not canonical) and return what is known of it."""
        entry = self._entries.pop(vector_id, None)
        if entry is None:
            vector = decode(content)
            entry = CachedVector(content, vector.hidden_size, frozenset(vector.layers))
            self._bytes += len(content)
        self._entries[vector_id] = entry
        while len(self._entries) > self.max_entries or (self._bytes > self.max_bytes and len(self._entries) > 1):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted.content)
        return entry

    def touch(self, vector_id: str) -> None:
        if vector_id in self._entries:
            self._entries.move_to_end(vector_id)
