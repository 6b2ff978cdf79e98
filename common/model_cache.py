"""The model cache (``settings.cache_dir``): converted models, one directory each, named by what they
were made from, so that every checkout and virtual environment on a machine shares one conversion.

A GGUF's conversion is named by the SHA-256 of the GGUF's bytes (not its path or mtime: each venv
installs its own copy of the same file). Hashing 100 MB costs a few tenths of a second, so the digest
is remembered in ``cache_dir/.digests/`` under the file's path, size and mtime; a file that changes
gets a new entry there and is hashed again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

DIGESTS = ".digests"
KERNELS = "kernels"  # the worker's compiled kernel libraries (each named by a digest of what built it)


def content_digest(path: Path, cache_dir: Path) -> str:
    """The hex SHA-256 of ``path``'s bytes, remembered by (path, size, mtime) in ``cache_dir``."""
    stat = path.stat()
    fingerprint = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    memo = cache_dir / DIGESTS / fingerprint[:32]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    digest = sha.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(digest)
    tmp.replace(memo)
    return digest


def entry_name(model: str, digest: str) -> str:
    """The cache directory of ``model`` converted from a file with this content digest."""
    return f"{model}-{digest[:16]}"


@dataclass(frozen=True)
class Entry:
    path: Path
    size_bytes: int


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def entries(cache_dir: Path) -> list[Entry]:
    """The converted models in ``cache_dir`` (its directories, bar the digest memo), by name."""
    if not cache_dir.is_dir():
        return []
    return [
        Entry(path=p, size_bytes=_size(p))
        for p in sorted(cache_dir.iterdir())
        if p.is_dir() and not p.name.startswith(".")
    ]


def remove(doomed: list[Entry]) -> int:
    """Delete these entries and their lock files; returns the bytes freed."""
    freed = 0
    for entry in doomed:
        shutil.rmtree(entry.path, ignore_errors=True)
        entry.path.with_name(entry.path.name + ".lock").unlink(missing_ok=True)
        freed += entry.size_bytes
    return freed
