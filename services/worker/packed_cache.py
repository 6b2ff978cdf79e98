"""Packed weight layers kept on disk beside the converted model, so a warm start maps them instead of
reading the GGUF's blocks and packing them again (seconds of CPU at every start).

One safetensors file per key: what the packing depends on — the GGUF's content digest, the weights
mode, the layout (Tiller's own kernel's records, or torch's packed 4-bit layout), torch's version and
its CPU capability (torch's layout is its kernel's own, which may change with either), and the code
that reads, packs and stores the blocks (a digest of its source files, the kernel's C++ included: a
change there packs again rather than trusting an old layout). Its metadata repeats the key
and holds a CRC-32 of every tensor. A file whose key or any checksum does not match, or that cannot be
parsed, is reported and ignored (the layers are packed from the blocks again and the file is rewritten).
Writes go to a temporary file renamed over the old one, so a reader never sees half a file and two
workers starting at once each write a whole one. One file per weights mode is kept: writing one removes
that mode's files of other keys (another torch, older code), which would otherwise pile up ~100 MB each;
a worker still mapping one keeps its pages, and a checkout with the other key packs again next start.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import structlog
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

# beside this file: what the bytes depend on
PACKING_CODE = ("gguf_blocks.py", "quantized.py", "gguf_linear.py", "gguf_kernel.cpp", "packed_cache.py")
LAYOUTS = {True: "gguf_kernel", False: "int4pack"}  # by whether Tiller's kernel serves the blocks
log = structlog.get_logger()

Tensors = dict[str, torch.Tensor]


def _code_digest() -> str:
    sha = hashlib.sha256()
    for name in PACKING_CODE:
        sha.update((Path(__file__).with_name(name)).read_bytes())
    return sha.hexdigest()[:16]


def cache_key(gguf_digest: str, mode: str, layout: str) -> dict[str, str]:
    """What packed layers depend on: the GGUF's bytes (named by ``gguf_digest``) and the rest."""
    return {
        "code": _code_digest(),
        "gguf_sha256": gguf_digest,
        "weights": mode,
        "layout": layout,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _prefix(key: dict[str, str]) -> str:
    return f"packed-{key['weights']}-"


def cache_path(directory: Path, key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return directory / f"{_prefix(key)}{digest}.safetensors"


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


class PackedStore:
    """The packed layers of one key, by layer name (several module names joined for a fused layer):
    those read from the file, and those packed this start, to be written once all are made."""

    def __init__(self, path: Path, key: dict[str, str]) -> None:
        self.path = path
        self.key = key
        self.found: dict[str, Tensors] = {}  # read from the file
        self.dense: set[str] = set()  # layers the GGUF holds no blocks for (left dense)
        self.used: dict[str, Tensors] = {}  # what this start served or packed: the next file's content
        self.dirty = False

    @classmethod
    def open(cls, path: Path, key: dict[str, str]) -> PackedStore:
        """The store at ``path``: its layers when the file is there and sound, else empty (a file
        that is not sound is logged, then replaced by :meth:`save`)."""
        store = cls(path, key)
        if not path.is_file():
            return store
        try:
            store._read()
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:  # stale or corrupt
            log.warning("worker.packed_cache_invalid", path=str(path), reason=str(exc))
            store.found, store.dense = {}, set()
        return store

    def _read(self) -> None:
        """The file's layers, mapped (not copied), checked against the key and the checksums."""
        with safe_open(self.path, framework="pt") as f:
            meta = f.metadata() or {}
            stored = json.loads(meta.get("key", "null"))
            if stored != self.key:
                raise ValueError(f"made for {stored}, not {self.key}")
            crcs: dict[str, int] = json.loads(meta["crc32"])
            if set(f.keys()) != set(crcs):
                raise ValueError("the tensors are not those the checksums name")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        for name, tensor in tensors.items():
            if _crc(tensor) != crcs[name]:
                raise ValueError(f"checksum mismatch in {name}")
            layer, _, part = name.rpartition(":")
            self.found.setdefault(layer, {})[part] = tensor
        self.dense = set(json.loads(meta["dense"]))

    def get(self, layer: str) -> Tensors | None:
        """The stored tensors of ``layer`` (None: not stored)."""
        tensors = self.found.get(layer)
        if tensors is not None:
            self.used[layer] = tensors
        return tensors

    def is_dense(self, layer: str) -> bool:
        return layer in self.dense

    def put(self, layer: str, tensors: Tensors | None) -> None:
        """Record a layer packed this start (None: left dense)."""
        if tensors is None:
            self.dense.add(layer)
        else:
            self.used[layer] = tensors
        self.dirty = True

    def save(self) -> None:
        """Write what this start used, when anything was packed anew; a failure to write only costs
        the next start its packing, so it is logged, not raised."""
        if not self.dirty:
            return
        flat = {f"{layer}:{part}": t.contiguous() for layer, parts in self.used.items() for part, t in parts.items()}
        meta = {
            "key": json.dumps(self.key, sort_keys=True),
            "crc32": json.dumps({name: _crc(t) for name, t in flat.items()}),
            "dense": json.dumps(sorted(self.dense)),
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            save_file(flat, str(tmp), metadata=meta)
            tmp.replace(self.path)
        except (OSError, SafetensorError) as exc:
            log.warning("worker.packed_cache_unwritable", path=str(self.path), error=str(exc))
            tmp.unlink(missing_ok=True)
            return
        self.dirty = False
        for other in self.path.parent.glob(f"{_prefix(self.key)}*.safetensors"):
            if other != self.path:
                other.unlink(missing_ok=True)
        log.info("worker.packed_cache_written", path=str(self.path), layers=len(self.used))
