"""What a controller may steer with and read out (ABI.md "Steering and readouts"): the scope the scheduler binds
with a sequence (the worker's readout concepts and layers, the request's own vectors) under ``settings.steering``'s
bounds, and the per-call collector of the steering changes and readout requests a main-channel reply carries."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from common import aici_wire
from common.config import Steering
from common.steering import CONCEPT_PREFIX
from common.wire import DECODE_ERRORS, SteeringTerm

_terms = msgspec.json.Decoder(list[SteeringTerm])


class SteeringRefused(ValueError):
    """A steering a controller asked for that cannot be served (the message says why); the host call returns -1."""


@dataclass(frozen=True)
class SteerScope:
    """What one request's controllers may steer with and read out."""

    concepts: tuple[str, ...]
    readout_layers: tuple[int, ...]
    vectors: dict[str, tuple[int, ...]]  # id -> the vector's own layers
    num_layers: int  # the model's decoder layers (0: unknown)
    limits: Steering

    @classmethod
    def of(cls, op: aici_wire.PreOp, limits: Steering) -> SteerScope:
        return cls(tuple(op.concepts), tuple(op.readout_layers),
                   {vid: tuple(layers) for vid, layers in op.vectors.items()}, op.num_layers, limits)

    def info(self) -> dict[str, list]:
        """The readout's concept names and 0-based decoder layers, in its order (``tiller_readout_info``)."""
        return {"concepts": list(self.concepts), "layers": list(self.readout_layers)}

    def terms(self, data: bytes | list) -> list[SteeringTerm]:
        """The steering ``data`` (JSON bytes, or a native controller's list of dicts) names, checked; SteeringRefused."""
        try:
            terms = _terms.decode(data) if isinstance(data, bytes) else msgspec.convert(data, list[SteeringTerm])
        except DECODE_ERRORS as exc:
            raise SteeringRefused(f"malformed steering: {exc}") from exc
        limits = self.limits
        if len(terms) > limits.max_vectors_per_request:
            raise SteeringRefused(f"{len(terms)} steering terms, more than the {limits.max_vectors_per_request} a "
                                  "request may have (steering.max_vectors_per_request)")
        pairs = 0
        for term in terms:
            own = self._layers_of(term.vector)
            if term.layers and term.vector in self.vectors and not set(term.layers) <= set(own):
                raise SteeringRefused(f"vector {term.vector} has no direction for layers "
                                      f"{sorted(set(term.layers) - set(own))}")
            if self.num_layers and max(term.layers, default=0) >= self.num_layers:
                raise SteeringRefused(f"layer {max(term.layers)} is past the model's {self.num_layers} decoder layers")
            if abs(term.scale) > limits.max_scale:
                raise SteeringRefused(f"scale {term.scale} is past the {limits.max_scale} allowed (steering.max_scale)")
            pairs += len(term.layers or own)
        if pairs > limits.max_layers_per_request:
            raise SteeringRefused(f"the steering adds up {pairs} (vector, layer) pairs, more than the "
                                  f"{limits.max_layers_per_request} allowed (steering.max_layers_per_request)")
        return terms

    def _layers_of(self, vector: str) -> tuple[int, ...]:
        """The layers a term of ``vector`` steers by default; SteeringRefused for a vector it may not name."""
        if vector.startswith(CONCEPT_PREFIX):
            if vector[len(CONCEPT_PREFIX):] not in self.concepts:
                raise SteeringRefused(f"unknown concept {vector!r}; the worker reads out {list(self.concepts)}")
            return self.readout_layers
        own = self.vectors.get(vector)
        if own is None:
            raise SteeringRefused(f"unknown vector {vector!r}: a controller steers with readout concepts "
                                  "(concept:<name>) and the vectors of its request's own steering")
        return own


@dataclass
class Effects:
    """What the controllers asked of the scheduler during one main-channel call (:class:`aici_wire.HostEffects`)."""

    steering: dict[int, list[SteeringTerm]] = field(default_factory=dict)  # seq id -> its steering set last
    readouts_on: list[int] = field(default_factory=list)

    def into(self, reply: aici_wire.HostEffects) -> None:
        """Move what was collected into ``reply``."""
        if self.steering:
            reply.steering = [aici_wire.SeqSteering(id=i, terms=t) for i, t in self.steering.items()]
            self.steering = {}
        if self.readouts_on:
            reply.readouts_on, self.readouts_on = self.readouts_on, []
