"""resolve_steering (services/gateway/steering.py): a client's steering checked against settings.steering and the
served model, its vectors resolved through the store (a fake here) and their content cached by id; every refusal a
GatewayError with a specific message."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from common import wire
from common.config import Settings, Steering
from common.errors import INVALID_REQUEST, MODEL_LOADING_ERROR
from common.steering import SteeringVector, encode, vector_id
from services.gateway.protocol import GatewayError
from services.gateway.steering import resolve_steering
from services.gateway.store import StoreError
from services.gateway.vector_cache import VectorCache

HIDDEN, LAYERS = 8, 4
ALICE = wire.Principal(user="alice")


def canonical(layers: dict[int, float], hidden: int = HIDDEN) -> bytes:
    return encode(SteeringVector(hidden_size=hidden, directions={k: np.full(hidden, v, np.float32)
                                                                 for k, v in layers.items()}))


CALM = canonical({1: 0.5, 2: -0.5})
WIDE = canonical({1: 1.0}, hidden=HIDDEN * 2)
DEEP = canonical({1: 1.0, 9: 1.0})
VECTORS = {vector_id(c): c for c in (CALM, WIDE, DEEP)}
TAGS = {"alice.calm": vector_id(CALM)}


@dataclass
class FakeStore:
    """The session store's VectorLookup: alice reaches every vector and her tag; the asks are counted."""

    asked: list[list[str]] = field(default_factory=list)

    async def lookup_vectors(self, refs: list[str], caller: wire.Principal, cached: list[str]) -> wire.VectorFound:
        self.asked.append(list(refs))
        ids = []
        for ref in refs:
            vid = TAGS.get(ref, ref)
            if caller != ALICE or vid not in VECTORS:
                raise StoreError("not_found", f"unknown steering vector or tag {ref!r}")
            ids.append(vid)
        return wire.VectorFound(ids=ids, contents={v: VECTORS[v] for v in ids if v not in cached})


@dataclass
class FakeScheduler:
    facts: wire.ModelFacts

    async def health(self, max_age: float = 0.0) -> wire.HealthReply:
        return wire.HealthReply(service="scheduler", ready=True, facts=self.facts)


@dataclass
class FakeGateway:
    settings: Settings
    scheduler: FakeScheduler
    store: FakeStore = field(default_factory=FakeStore)
    vectors: VectorCache = field(default_factory=VectorCache)


def gateway(concepts: tuple[str, ...] = ("happy", "sad"), hidden: int = HIDDEN, **steering: Any) -> FakeGateway:
    facts = wire.ModelFacts(hidden_size=hidden, num_layers=LAYERS if hidden else 0, readout_concepts=list(concepts))
    return FakeGateway(Settings(steering=Steering(**steering)), FakeScheduler(facts))


def resolve(gw: FakeGateway, spec: object, who: wire.Principal = ALICE):
    return asyncio.run(resolve_steering(gw, spec, who))


def refused(gw: FakeGateway, spec: object, who: wire.Principal = ALICE) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        resolve(gw, spec, who)
    return caught.value


def test_terms_name_ids_and_carry_each_vectors_content_once():
    gw = gateway()
    calm = vector_id(CALM)
    terms, contents = resolve(gw, [{"vector": "alice.calm", "scale": 2},
                                   {"vector": calm, "scale": -0.5, "layers": [2], "positions": "generated"},
                                   {"vector": "concept:happy", "scale": 1.5, "layers": [0, 3]}])
    assert terms == [wire.SteeringTerm(vector=calm, scale=2.0),
                     wire.SteeringTerm(vector=calm, scale=-0.5, layers=[2], positions="generated"),
                     wire.SteeringTerm(vector="concept:happy", scale=1.5, layers=[0, 3])]
    assert contents == {calm: CALM}
    assert gw.store.asked == [["alice.calm", calm]]  # one lookup per request, each ref once
    assert resolve(gw, [], ALICE) == ([], {}) and len(gw.store.asked) == 1  # no steering: no store
    assert resolve(gw, None, ALICE) == ([], {}) and len(gw.store.asked) == 1


def test_a_concept_without_layers_steers_at_the_readout_layers():
    gw = gateway()
    gw.scheduler.facts.readout_layers = [1, 3]
    terms, contents = resolve(gw, [{"vector": "concept:sad", "scale": -2}])
    assert terms == [wire.SteeringTerm(vector="concept:sad", scale=-2.0, layers=[1, 3])] and contents == {}


def test_cached_content_is_not_sent_again_but_who_may_use_it_is_asked_each_time():
    gw = gateway()
    resolve(gw, [{"vector": "alice.calm", "scale": 1}])
    assert gw.vectors.snapshot().keys() == {vector_id(CALM)}
    terms, contents = resolve(gw, [{"vector": "alice.calm", "scale": 1}])
    assert contents == {vector_id(CALM): CALM} and len(gw.store.asked) == 2
    bob = refused(gw, [{"vector": vector_id(CALM), "scale": 1}], wire.Principal(user="bob"))
    assert bob.code == INVALID_REQUEST and "unknown steering vector or tag" in bob.message


@pytest.mark.parametrize(("spec", "message"), [
    ({"vector": "x", "scale": 1}, "steering must be a list"),
    ([{"vector": "alice.calm"}], "steering[0].scale: Field required"),
    ([{"vector": "alice.calm", "scale": "1"}], "steering[0].scale"),
    ([{"vector": "alice.calm", "scale": True}], "steering[0].scale"),
    ([{"vector": "alice.calm", "scale": float("nan")}], "steering[0].scale"),
    ([{"vector": "alice.calm", "scale": float("inf")}], "steering[0].scale"),
    ([{"vector": "alice.calm", "scale": 1001}], "outside [-1000.0, 1000.0] (steering.max_scale)"),
    ([{"vector": "alice.calm", "scale": -1001}], "steering.max_scale"),
    ([{"vector": "alice.calm", "scale": 1, "colour": "red"}], "steering[0].colour: unknown field"),
    ([{"vector": "alice.calm", "scale": 1, "positions": "middle"}], "steering[0].positions"),
    ([{"vector": "alice.calm", "scale": 1, "layers": []}], "steering[0].layers"),
    ([{"vector": "alice.calm", "scale": 1, "layers": [-1]}], "steering[0].layers[0]"),
    ([{"vector": "alice.calm", "scale": 1, "layers": [1, 1]}], "a layer is named twice"),
    ([{"vector": "alice.calm", "scale": 1, "layers": [3]}], "has no direction for layers [3]"),
    ([{"vector": "alice.nope", "scale": 1}], "unknown steering vector or tag 'alice.nope'"),
    ([{"vector": vector_id(WIDE), "scale": 1}], "has hidden size 16; the served model's is 8"),
    ([{"vector": vector_id(DEEP), "scale": 1}], "layers [9] outside the served model's 4 decoder layers"),
    ([{"vector": "concept:angry", "scale": 1, "layers": [1]}], "'angry' is not a readout concept"),
    ([{"vector": "concept:happy", "scale": 1}], "the readout layers are not known yet"),
    ([{"vector": "concept:", "scale": 1, "layers": [1]}], "'' is not a readout concept"),
    ([{"vector": "concept:happy", "scale": 1, "layers": [4]}], "[4] outside the served model's 4 decoder layers"),
    ([{"vector": "alice.calm", "scale": 1}] * 9, "at most 8 are allowed (steering.max_vectors_per_request)"),
])
def test_each_bad_spec_is_refused_saying_why(spec: object, message: str):
    error = refused(gateway(), spec)
    assert error.code == INVALID_REQUEST and message in error.message, error.message


def test_layer_pairs_count_against_their_limit_and_zero_vectors_turns_steering_off():
    spec = [{"vector": "alice.calm", "scale": 1}, {"vector": "concept:sad", "scale": 1, "layers": [0, 1, 2]}]
    assert "5 (vector, layer) pairs; at most 4" in refused(gateway(max_layers_per_request=4), spec).message
    assert len(resolve(gateway(max_layers_per_request=5), spec)[0]) == 2
    assert "turned off" in refused(gateway(max_vectors_per_request=0), spec).message
    assert resolve(gateway(max_vectors_per_request=0), []) == ([], {})


def test_any_concept_passes_while_the_concepts_are_unknown_and_nothing_passes_before_the_model_is():
    terms, _ = resolve(gateway(concepts=()), [{"vector": "concept:anything", "scale": 1, "layers": [0]}])
    assert terms[0].vector == "concept:anything"
    assert refused(gateway(hidden=0), [{"vector": "alice.calm", "scale": 1}]).code == MODEL_LOADING_ERROR
