"""Steering vector files as clients make them (docs/steering.md, "Vectors"), for the tests that upload them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGUFWriter


def as_json(directions: dict[int, np.ndarray]) -> bytes:
    return json.dumps({"directions": {str(k): v.tolist() for k, v in directions.items()}}).encode()


def as_gguf(tmp_path: Path, tensors: dict[str, np.ndarray], arch: str = "controlvector") -> bytes:
    """A control vector as repeng's export_gguf writes one (gguf's GGUFWriter)."""
    path = tmp_path / "vector.gguf"
    writer = GGUFWriter(path, arch)
    writer.add_string(f"{arch}.model_hint", "llama")
    writer.add_uint32(f"{arch}.layer_count", len(tensors))
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()
