"""The engine's side of activation steering (docs/steering.md): a sequence's terms checked and resolved.

A SeqStep's ``steering`` names vectors by id (their canonical content in ``vectors``, or decoded already for
another live sequence) or readout concepts (``concept:<name>``: the concept's row of the readout matrix at
unit norm, on the readout layers by default). :meth:`Vectors.resolve` checks every term against the model
and sums them into the :class:`~services.worker.layers.steering.Deltas` the runners add. Decoded vectors
are kept only while a live sequence's steering holds them (weak references), and sequences with the same
terms share one resolved steering, so a step adds each distinct vector once per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from weakref import WeakValueDictionary

import torch

from common import steering as canonical
from common.wire import SteeringTerm
from services.worker.layers.steering import Deltas, Term, combine
from services.worker.readouts import Readouts


class SteeringInvalid(ValueError):
    """A sequence's steering cannot be served (the message says why)."""


@dataclass(eq=False)
class _Vector:
    name: str  # how the terms name it (an id, or "concept:<name>")
    directions: dict[int, torch.Tensor]  # layer -> float32 [hidden], on the model's device
    layers: list[int]  # the layers it steers when a term names none


@dataclass(eq=False)
class Steering:
    """A sequence's resolved steering; it holds the vectors it uses (so they stay decoded)."""

    deltas: Deltas
    vectors: tuple[_Vector, ...]


def _key(terms: Sequence[SteeringTerm]) -> tuple:
    return tuple((t.vector, t.scale, tuple(t.layers), t.positions) for t in terms)


class Vectors:
    """Resolves steering terms for a model of ``num_layers`` decoder layers of ``hidden_size``."""

    def __init__(self, num_layers: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 readouts: Readouts | None) -> None:
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.dtype, self.device = dtype, device
        self.readouts = readouts
        self.decoded: WeakValueDictionary[str, _Vector] = WeakValueDictionary()  # by id, while a sequence uses it
        self._resolved: WeakValueDictionary[tuple, Steering] = WeakValueDictionary()  # by terms, while in use
        self._concepts: dict[str, _Vector] = {}

    def resolve(self, terms: Sequence[SteeringTerm], contents: dict[str, bytes]) -> Steering | None:
        """The steering of ``terms`` (None: no terms); ``contents``: canonical vectors by id. SteeringInvalid
        names the first term that cannot be served."""
        if not terms:
            return None
        key = _key(terms)
        known = self._resolved.get(key)
        if known is not None:
            return known
        vectors = tuple(self._vector(t.vector, contents) for t in terms)
        resolved = [Term(self._directions(v, t.layers), t.scale, t.positions) for t, v in zip(terms, vectors)]
        steering = Steering(combine(resolved, self.dtype), vectors)
        self._resolved[key] = steering
        return steering

    def _vector(self, name: str, contents: dict[str, bytes]) -> _Vector:
        if name.startswith(canonical.CONCEPT_PREFIX):
            return self._concept(name)
        known = self.decoded.get(name)
        if known is not None:
            return known
        data = contents.get(name)
        if data is None:
            raise SteeringInvalid(f"steering vector {name} is unknown to this worker and its content was not sent")
        if canonical.vector_id(data) != name:
            raise SteeringInvalid(f"steering vector {name}: the content sent has id {canonical.vector_id(data)}")
        try:
            vector = canonical.decode(data)
        except canonical.SteeringError as exc:
            raise SteeringInvalid(f"steering vector {name}: {exc}") from exc
        if vector.hidden_size != self.hidden_size:
            raise SteeringInvalid(f"steering vector {name} has hidden size {vector.hidden_size}, the model "
                                  f"{self.hidden_size}")
        directions = {layer: torch.from_numpy(d).to(self.device) for layer, d in vector.directions.items()}
        decoded = self.decoded[name] = _Vector(name, directions, vector.layers)
        return decoded

    def _concept(self, name: str) -> _Vector:
        concept = name.removeprefix(canonical.CONCEPT_PREFIX)
        if self.readouts is None:
            raise SteeringInvalid(f"steering {name}: this worker has no readout concepts")
        if concept not in self.readouts.concepts:
            raise SteeringInvalid(f"steering {name}: unknown concept (this worker's: "
                                  f"{', '.join(self.readouts.concepts)})")
        known = self._concepts.get(name)
        if known is None:
            row = self.readouts.matrix[self.readouts.concepts.index(concept)].float()
            unit = row / row.norm()  # one direction on every layer; the readout layers by default
            known = self._concepts[name] = _Vector(name, dict.fromkeys(range(self.num_layers), unit),
                                                   list(self.readouts.layers))
        return known

    def _directions(self, vector: _Vector, layers: list[int]) -> dict[int, torch.Tensor]:
        """The vector's directions on ``layers`` (empty: its own), each a layer of the model it has."""
        chosen = layers or vector.layers
        for layer in chosen:
            if not 0 <= layer < self.num_layers:
                raise SteeringInvalid(f"steering {vector.name}: layer {layer} is outside the model's "
                                      f"{self.num_layers} decoder layers")
            if layer not in vector.directions:
                raise SteeringInvalid(f"steering vector {vector.name} has no direction for layer {layer}")
        return {layer: vector.directions[layer] for layer in chosen}
