"""Steering vectors: directions added to the residual stream after chosen decoder layers (docs/steering.md).

A vector is ``hidden_size`` and, per 0-based decoder layer ``i``, one float32 direction added to the output of
transformers' ``model.model.layers[i]`` (the residual stream after that layer). Vectors are content-addressed:
:func:`encode` writes the one canonical form (layers ascending, float32 little-endian) and a vector's id is the
SHA-256 of it, so the same directions uploaded as GGUF, safetensors or JSON get the same id. The parsers of those
upload formats are in :mod:`common.steering_formats`; this module is what every service shares (the gateway checks
and stores, the worker decodes and adds).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"tiller-steering-v1\n"
_HEADER = struct.Struct("<II")  # hidden_size, layers
_LAYER = struct.Struct("<I")
CONCEPT_PREFIX = "concept:"  # a readout concept's direction (docs/steering.md, "Concepts are vectors")


class SteeringError(ValueError):
    """A vector that cannot be served: malformed, wrong size, not finite (the message says which)."""


@dataclass(frozen=True)
class SteeringVector:
    hidden_size: int
    directions: dict[int, np.ndarray]  # 0-based layer -> float32 [hidden_size]

    def __post_init__(self) -> None:
        if self.hidden_size < 1:
            raise SteeringError(f"hidden size {self.hidden_size} is not positive")
        if not self.directions:
            raise SteeringError("a steering vector needs at least one layer's direction")
        for layer, direction in self.directions.items():
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise SteeringError(f"layer {layer!r} is not a 0-based layer number")
            if direction.dtype != np.float32 or direction.shape != (self.hidden_size,):
                raise SteeringError(f"layer {layer}'s direction has shape {tuple(direction.shape)}, not "
                                    f"({self.hidden_size},) float32")
            if not np.isfinite(direction).all():
                raise SteeringError(f"layer {layer}'s direction holds NaN or Inf")

    @classmethod
    def of(cls, directions: dict[int, object]) -> SteeringVector:
        """A vector from per-layer sequences of floats (any numeric type), checked; all of one length."""
        if not directions:
            raise SteeringError("a steering vector needs at least one layer's direction")
        arrays: dict[int, np.ndarray] = {}
        for layer, values in directions.items():
            try:
                array = np.asarray(values, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise SteeringError(f"layer {layer}'s direction is not a list of numbers") from e
            if array.ndim != 1:
                raise SteeringError(f"layer {layer}'s direction is not one flat list of numbers")
            if not np.isfinite(array).all():
                raise SteeringError(f"layer {layer}'s direction holds NaN or Inf")
            if np.abs(array).max(initial=0.0) > np.finfo(np.float32).max:
                raise SteeringError(f"layer {layer}'s direction holds values too large for float32")
            arrays[layer] = array.astype(np.float32)
        sizes = {a.shape[0] for a in arrays.values()}
        if len(sizes) != 1:
            raise SteeringError(f"the layers' directions differ in length: {sorted(sizes)}")
        return cls(hidden_size=sizes.pop(), directions=arrays)

    @property
    def layers(self) -> list[int]:
        return sorted(self.directions)

    def norms(self) -> dict[int, float]:
        """Each layer's direction's Euclidean norm."""
        return {layer: float(np.linalg.norm(self.directions[layer])) for layer in self.layers}


def encode(vector: SteeringVector) -> bytes:
    """The canonical form: its SHA-256 is the vector's id."""
    parts = [MAGIC, _HEADER.pack(vector.hidden_size, len(vector.directions))]
    for layer in vector.layers:
        parts.append(_LAYER.pack(layer))
        parts.append(vector.directions[layer].astype("<f4").tobytes())
    return b"".join(parts)


def decode(data: bytes) -> SteeringVector:
    """A vector from its canonical form; SteeringError when ``data`` is not one."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER.size:
        raise SteeringError("not a canonical steering vector")
    hidden, count = _HEADER.unpack_from(data, len(MAGIC))
    record = _LAYER.size + 4 * hidden
    offset = len(MAGIC) + _HEADER.size
    if len(data) != offset + count * record:
        raise SteeringError(f"a canonical vector of {count} layers of {hidden} floats is "
                            f"{offset + count * record} bytes, not {len(data)}")
    directions: dict[int, np.ndarray] = {}
    for _ in range(count):
        (layer,) = _LAYER.unpack_from(data, offset)
        if layer in directions:
            raise SteeringError(f"layer {layer} appears twice")
        directions[layer] = np.frombuffer(data, dtype="<f4", count=hidden, offset=offset + _LAYER.size).astype(np.float32)
        offset += record
    vector = SteeringVector(hidden_size=hidden, directions=directions)
    if encode(vector) != data:
        raise SteeringError("the layers of a canonical vector are not in ascending order")
    return vector


def vector_id(canonical: bytes) -> str:
    """The id of a vector in canonical form (:func:`encode`): SHA-256, hex."""
    return hashlib.sha256(canonical).hexdigest()
