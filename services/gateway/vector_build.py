"""A steering vector from contrastive examples (vectors:build, docs/steering.md): pure arithmetic, no I/O.

Contrastive Activation Addition (Panickssery et al.): for each pair, the residual stream after each chosen layer
at the last token of the positive text minus the negative's; the direction is their mean, at the scale the model's
activations have. ``pca`` (repeng's ``pca_diff``) takes instead the first principal component of the differences,
unit length, signed so that the positives project above the negatives on average.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from common.steering import SteeringError, SteeringVector

Method = Literal["mean", "pca"]


def residual_rows(data: bytes, layers: int, hidden: int) -> np.ndarray:
    """One position's residual stream as the scheduler reports it (float32 ``[layers][hidden]``, little-endian)."""
    if len(data) != 4 * layers * hidden:
        raise SteeringError(f"a residual of {len(data)} bytes is not {layers} layers of {hidden} floats")
    return np.frombuffer(data, dtype="<f4").reshape(layers, hidden).astype(np.float64)


def contrastive_vector(positives: list[np.ndarray], negatives: list[np.ndarray], layers: list[int],
                       method: Method = "mean") -> SteeringVector:
    """The vector of pairs ``(positives[i], negatives[i])``, each ``[len(layers), hidden]``: one direction per layer."""
    if not positives or len(positives) != len(negatives):
        raise SteeringError(f"{len(positives)} positives and {len(negatives)} negatives do not make pairs")
    differences = np.stack(positives) - np.stack(negatives)  # [pairs, layers, hidden]
    if not differences.any():
        raise SteeringError("every positive text has the same residual stream as its negative: no direction")
    directions = {}
    for i, layer in enumerate(layers):
        rows = differences[:, i, :]
        directions[layer] = _first_component(rows) if method == "pca" else rows.mean(axis=0)
    return SteeringVector.of(directions)


def _first_component(rows: np.ndarray) -> np.ndarray:
    """The unit direction along which ``rows`` (differences) vary most, pointing where their mean points."""
    mean = rows.mean(axis=0)
    centered = rows - mean if len(rows) > 1 else rows
    _, _, vt = np.linalg.svd(centered, full_matrices=False)
    component = vt[0]
    return -component if float(rows @ component @ np.ones(len(rows))) < 0 else component
