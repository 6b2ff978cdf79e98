"""Activation steering, the part the runners share: what a sequence adds after each layer, and a step's rows.

A sequence's steering terms, resolved by the engine, become one :class:`Deltas`: per 0-based decoder layer,
the vector added to its prompt positions' rows and the one added to its generated positions' rows (each the
sum of its terms' ``scale * direction`` whose ``positions`` cover them). A step's plan (:func:`plan_rows`)
turns the steered inputs' rows into, per layer, the rows and the delta rows to add to the residual stream
after that layer: one ``index_add_`` a steered layer, its cost proportional to the steered rows, and nothing
at all for a step with no steered row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.transfer import to_device

if TYPE_CHECKING:
    from services.worker.runner import SeqInput

# layer -> (rows [n] int64, deltas [n, hidden]): what a step adds after that layer (``x.index_add_(0, *it)``)
LayerAdds = dict[int, tuple[torch.Tensor, torch.Tensor]]

_COVERS = {"all": (True, True), "prompt": (True, False), "generated": (False, True)}  # (prompt rows, generated)


@dataclass(frozen=True, eq=False)
class Deltas:
    """A sequence's steering, summed: layer -> (delta of its prompt positions, of its generated ones), each
    ``[hidden]`` in the activations' dtype, None where nothing is added."""

    layers: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True)
class Term:
    """One steering term resolved: its directions by the layers it steers (float32 ``[hidden]``), its scale, and
    which positions it covers (``SteeringTerm.positions``)."""

    directions: Mapping[int, torch.Tensor]
    scale: float
    positions: str


def combine(terms: Iterable[Term], dtype: torch.dtype) -> Deltas:
    """The terms added up by layer and by the positions they cover (float32 sums, then ``dtype``)."""
    sums: dict[int, list[torch.Tensor | None]] = {}
    for term in terms:
        covers = _COVERS[term.positions]
        for layer, direction in term.directions.items():
            pair = sums.setdefault(layer, [None, None])
            for side in (0, 1):
                if covers[side]:
                    scaled = term.scale * direction.float()
                    pair[side] = scaled if pair[side] is None else pair[side] + scaled
    return Deltas({layer: tuple(None if d is None else d.to(dtype) for d in pair)  # type: ignore[misc]
                   for layer, pair in sorted(sums.items())})


def plan_rows(inputs: Sequence[SeqInput], first_row: Sequence[int], device: torch.device) -> LayerAdds:
    """What a step adds after each layer: ``inputs[i]`` feeds rows ``first_row[i] ..`` at positions
    ``inputs[i].start ..``; a row whose position is before its input's ``output_start`` is a prompt position.
    Inputs that share a :class:`Deltas` share its vectors: each layer's delta rows are gathered from the
    distinct vectors it adds."""
    rows: dict[int, list[int]] = {}
    which: dict[int, list[int]] = {}
    bank: dict[int, dict[int, tuple[int, torch.Tensor]]] = {}  # layer -> id(vector) -> (its index, it)
    for item, first in zip(inputs, first_row):
        if item.steering is None:
            continue
        n = len(item.tokens)
        split = min(max(item.output_start - item.start, 0), n)  # rows before it are prompt positions
        for layer, (prompt, generated) in item.steering.layers.items():
            for delta, lo, hi in ((prompt, 0, split), (generated, split, n)):
                if delta is None or lo == hi:
                    continue
                vectors = bank.setdefault(layer, {})
                index = vectors.setdefault(id(delta), (len(vectors), delta))[0]
                rows.setdefault(layer, []).extend(range(first + lo, first + hi))
                which.setdefault(layer, []).extend([index] * (hi - lo))
    adds: LayerAdds = {}
    for layer, vectors in bank.items():
        stacked = [delta for _, delta in vectors.values()]
        if len(stacked) == 1:
            deltas = stacked[0].expand(len(rows[layer]), -1)
        else:
            deltas = torch.stack(stacked).index_select(0, to_device(which[layer], device))
        adds[layer] = (to_device(rows[layer], device), deltas)
    return adds
