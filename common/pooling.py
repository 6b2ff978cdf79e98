"""Embeddings by pooling: one vector for a prompt from its final hidden states (after the final norm).

``last`` takes the last prompt position's hidden state (in a causal model the only one that has seen every
token); ``mean`` averages every position's. The worker sums the pooled positions each step feeds (a prompt may
take several prefill chunks), the scheduler adds the chunks' sums up (:class:`PooledSum`), and the gateway
normalizes the vector and encodes it as OpenAI does (:func:`unit`, :func:`encode`).
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np

Pooling = Literal["last", "mean"]
EncodingFormat = Literal["float", "base64"]


def pooled_positions(pooling: Pooling, prompt_len: int) -> range:
    """The prompt positions whose final hidden states make the embedding."""
    return range(prompt_len - 1, prompt_len) if pooling == "last" else range(prompt_len)


def vector_bytes(vector: np.ndarray) -> bytes:
    """A vector as little-endian float32 bytes (the wire's, and OpenAI's base64 encoding's)."""
    return np.asarray(vector, dtype="<f4").tobytes()


def vector_of(data: bytes) -> np.ndarray:
    """The float32 vector of :func:`vector_bytes`; ValueError when ``data`` is not whole floats."""
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes are not float32 values")
    return np.frombuffer(data, dtype="<f4")


class PooledSum:
    """The sum of a prompt's pooled hidden states as steps report them, one partial sum per step."""

    def __init__(self, positions: range) -> None:
        self.positions = positions
        self.seen = 0  # pooled positions added so far
        self._total: np.ndarray | None = None  # float64: a long prompt's sum loses nothing to rounding

    def add(self, data: bytes, count: int) -> None:
        """Add a step's sum (``vector_bytes``) of ``count`` pooled positions."""
        part = vector_of(data).astype(np.float64)
        if not part.size:
            raise ValueError("no pooled sum was reported")
        if self._total is not None and part.shape != self._total.shape:
            raise ValueError(f"a pooled sum of {part.size} values after ones of {self._total.size}")
        self._total = part if self._total is None else self._total + part
        self.seen += count

    @property
    def complete(self) -> bool:
        return self._total is not None and self.seen == len(self.positions)

    def vector(self) -> np.ndarray:
        """The pooled vector (the mean of the pooled positions' hidden states), float32."""
        if not self.complete:
            raise ValueError(f"{self.seen} of {len(self.positions)} pooled positions were reported")
        assert self._total is not None
        return (self._total / self.seen).astype(np.float32)


def unit(vector: np.ndarray) -> np.ndarray:
    """``vector`` scaled to length 1 (as OpenAI's embeddings are: cosine similarity is then a dot product);
    a zero vector stays zero."""
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    return vector if norm == 0.0 else (vector / norm).astype(np.float32)


def encode(vector: np.ndarray, encoding_format: EncodingFormat) -> list[float] | str:
    """The ``embedding`` of OpenAI's response: a list of floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(vector)).decode()
    return np.asarray(vector, dtype=np.float32).tolist()
