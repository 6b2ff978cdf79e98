"""Activation steering, the part the runners share: what a sequence adds after each layer, and a step's rows.

A sequence's steering terms, resolved by the engine, become one :class:`Deltas`: per 0-based decoder layer,
the vector added to its prompt positions' rows and the one added to its generated positions' rows (each the
sum of its terms' ``scale * direction`` whose ``positions`` cover them). A step's plan (:func:`plan_rows`)
turns the steered inputs' rows into, per layer, the rows and the delta rows to add to the residual stream
after that layer (:class:`LayerAdd`): one broadcast add or ``index_add_`` a steered layer, its cost
proportional to the steered rows, and nothing at all for a step with no steered row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.worker.transfer import to_device

if TYPE_CHECKING:
    from services.worker.runner import SeqInput


_COVERS = {"all": (True, True), "prompt": (True, False), "generated": (False, True)}  # (prompt rows, generated)


@dataclass(frozen=True, eq=False)
class Deltas:
    """A sequence's steering, summed: layer -> (delta of its prompt positions, of its generated ones), each
    ``[hidden]`` in the activations' dtype, None where nothing is added."""

    layers: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True)
class LayerAdd:
    """What a step adds to the rows after one layer: a range of rows that all get one vector ``[hidden]`` (a
    batch whose steered sequences share their steering), or rows ``[n]`` and their deltas ``[n, hidden]``."""

    rows: slice | torch.Tensor
    deltas: torch.Tensor

    def apply(self, x: torch.Tensor) -> None:
        """Add to ``x`` ``[rows, hidden]`` in place."""
        if isinstance(self.rows, slice):
            x[self.rows].add_(self.deltas)
        else:
            x.index_add_(0, self.rows, self.deltas)


LayerAdds = dict[int, LayerAdd]  # by 0-based decoder layer


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

    def cast(delta: torch.Tensor | None) -> torch.Tensor | None:
        return None if delta is None else delta.to(dtype)

    return Deltas({layer: (cast(prompt), cast(generated)) for layer, (prompt, generated) in sorted(sums.items())})


def plan_rows(inputs: Sequence[SeqInput], first_row: Sequence[int], device: torch.device) -> LayerAdds:
    """What a step adds after each layer: ``inputs[i]`` feeds rows ``first_row[i] ..`` at positions
    ``inputs[i].start ..``; a row whose position is before its input's ``output_start`` is a prompt position.
    Inputs that share a :class:`Deltas` (the same terms) are taken together, so the host's work is per
    distinct steering and layer, plus a list entry per steered row."""
    groups: dict[int, tuple[Deltas, list[int], list[int]]] = {}  # id(deltas) -> (it, prompt rows, generated rows)
    for item, first in zip(inputs, first_row):
        if item.steering is None:
            continue
        n = len(item.tokens)
        split = min(max(item.output_start - item.start, 0), n)  # rows before it are prompt positions
        _, prompt_rows, generated_rows = groups.setdefault(id(item.steering), (item.steering, [], []))
        prompt_rows.extend(range(first, first + split))
        generated_rows.extend(range(first + split, first + n))
    pieces: dict[int, list[tuple[list[int], torch.Tensor]]] = {}  # layer -> (rows, the vector they get)
    for deltas, prompt_rows, generated_rows in groups.values():
        for layer, (prompt, generated) in deltas.layers.items():
            for vector, rows in ((prompt, prompt_rows), (generated, generated_rows)):
                if vector is not None and rows:
                    pieces.setdefault(layer, []).append((rows, vector))
    adds: LayerAdds = {}
    indices: dict[tuple[int, ...], torch.Tensor] = {}  # the layers' row indices, made once per distinct list
    for layer, parts in pieces.items():
        if len(parts) == 1 and max(parts[0][0]) - min(parts[0][0]) + 1 == len(parts[0][0]):  # distinct rows: a range
            rows, vector = parts[0]
            adds[layer] = LayerAdd(slice(min(rows), max(rows) + 1), vector)
            continue
        key = tuple(id(rows) for rows, _ in parts)
        if key not in indices:
            indices[key] = to_device([r for rows, _ in parts for r in rows], device)
        # contiguous delta rows: index_add_ reads a broadcast (stride 0) source several times slower
        adds[layer] = LayerAdd(indices[key], torch.cat([vector.expand(len(rows), -1) for rows, vector in parts]))
    return adds
