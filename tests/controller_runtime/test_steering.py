"""Steering and readout host calls (ABI.md "Steering and readouts"): tiller_steer's checks, readouts asked for and
handed to the controller, and the shipped concept_guard (Wasm and native) steering against a rising readout."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from common import aici_wire
from tests.controller_runtime.conftest import bound, mid, start
from tests.controller_runtime.wat import MID_SAMPLE, controller, ret_const, str_data

GUARD_WASM = (Path(__file__).resolve().parents[2] / "controllers" / "wasm" / "concept_guard.wasm").read_bytes()
SCOPE = {"concepts": ["happy", "sad"], "readout_layers": [3, 7], "num_layers": 300, "vectors": {"v1": [2, 5]}}
POST_OK = ret_const(1200, '{"stop":false}')
IOV, DATA = 16384, 16512  # an iovec for fd_write, and where the host calls write


def steer_on_post(terms: object) -> bytes:
    """A controller whose post_process sets ``terms`` (JSON) as its steering."""
    text = json.dumps(terms)
    return controller(post=f"(drop (call $steer (i32.const 20000) (i32.const {len(text.encode())}))) {POST_OK}",
                      data=str_data(20000, text))


def logging(call: str) -> str:
    """A body that logs the ``n`` bytes that ``call`` (a host call writing at DATA) returns it wrote."""
    return (f"(i32.store (i32.const {IOV}) (i32.const {DATA})) (i32.store (i32.const {IOV + 4}) {call}) "
            f"(drop (call $fd_write (i32.const 1) (i32.const {IOV}) (i32.const 1) (i32.const {IOV + 8})))")


def post(runtime, seq_id: int, **fields) -> dict:
    return runtime.post_pre_process(aici_wire.PostPreProcess(post_ops=[aici_wire.PostOp(id=seq_id, tokens=[5])],
                                                             **fields))


def test_steer_sets_the_sequence_steering_from_its_next_token_in_the_reply(runtime):
    terms = [{"vector": "concept:happy", "scale": -4.0}, {"vector": "v1", "scale": 2.0, "layers": [5],
                                                          "positions": "generated"}]
    start(runtime, steer_on_post(terms), 1, **SCOPE)
    reply = post(runtime, 1)
    assert reply["post_seqs"]["1"]["error"] == "" and reply["steering"] == [{"id": 1, "terms": terms}]
    assert post(runtime, 1)["steering"] == [{"id": 1, "terms": terms}]  # each call's own: set again, reported again
    assert runtime.post_pre_process(aici_wire.PostPreProcess())["steering"] == []


@pytest.mark.parametrize("terms, why", [
    ([{"vector": 7, "scale": 1}], "malformed steering"),
    ([{"vector": "concept:happy", "scale": 1, "positions": "later"}], "malformed steering"),
    ([{"vector": "concept:angry", "scale": 1}], "unknown concept 'concept:angry'"),
    ([{"vector": "v2", "scale": 1}], "unknown vector 'v2'"),
    ([{"vector": "v1", "scale": 1, "layers": [3]}], "vector v1 has no direction for layers [3]"),
    ([{"vector": "concept:sad", "scale": -1e4}], "past the 1000.0 allowed (steering.max_scale)"),
    ([{"vector": "concept:sad", "scale": 1}] * 9, "9 steering terms, more than the 8"),
    ([{"vector": "concept:sad", "scale": 1, "layers": list(range(200))}] * 2, "400 (vector, layer) pairs"),
    ([{"vector": "concept:sad", "scale": 1, "layers": [3, 300]}], "layer 300 is past the model's 300 decoder layers"),
])
def test_a_steering_the_request_may_not_have_is_refused_and_logged(runtime, terms, why):
    start(runtime, steer_on_post(terms), 1, **SCOPE)
    reply = post(runtime, 1)
    assert reply["post_seqs"]["1"]["error"] == "" and reply["steering"] == []  # -1: the controller goes on
    assert why in reply["post_seqs"]["1"]["logs"], reply["post_seqs"]["1"]["logs"]


def test_steering_and_readout_info_wait_for_the_binding(runtime):
    steer = '(drop (call $steer (i32.const 20000) (i32.const 2)))'
    info = f"(drop (call $readout_info (i32.const {DATA}) (i32.const 256)))"
    wasm = controller(init_prompt=f"{steer} {info} {ret_const(1024, '{}')}", data=str_data(20000, "[]"))
    ok, outcome = runtime.instantiate("r1", [1], runtime.registry.create(wasm, "test")["module_id"], "")
    assert ok and "steering is set from the sequence's first pre_process on" in outcome["logs"]
    assert "the readout is known from the sequence's first pre_process on" in outcome["logs"]


def test_readouts_asked_for_in_init_prompt_are_handed_to_each_callback(runtime):
    info = logging(f"(call $readout_info (i32.const {DATA}) (i32.const 256))")
    wasm = controller(init_prompt=f"(drop (call $readout (i32.const 0) (i32.const 0))) {ret_const(1024, '{}')}",
                      post=f"{logging(f'(call $readout (i32.const {DATA}) (i32.const 64))')} {info} {POST_OK}")
    assert bound(runtime, wasm, 1, **SCOPE)["readouts_on"] == [1]  # the scheduler asks the worker from now on
    reply = post(runtime, 1, readouts=[aici_wire.SeqReadout(id=1, values=b"ABCDEFGH")])
    assert reply["post_seqs"]["1"]["logs"] == 'ABCDEFGH{"concepts":["happy","sad"],"layers":[3,7]}'
    assert post(runtime, 1)["post_seqs"]["1"]["logs"].startswith("ABCDEFGH")  # the last one, until the next
    assert post(runtime, 1)["readouts_on"] == []


def test_a_first_readout_call_after_the_binding_asks_for_readouts_in_its_reply(runtime):
    wasm = controller(post=f"(drop (call $readout (i32.const 0) (i32.const 0))) {POST_OK}")
    assert bound(runtime, wasm, 1, **SCOPE)["readouts_on"] == []
    assert post(runtime, 1)["readouts_on"] == [1]
    assert post(runtime, 1)["readouts_on"] == []


def readout(happy: float) -> bytes:
    """A readout of SCOPE's shape: [2 layers][happy, sad], happy's mean ``happy``."""
    return struct.pack("<4f", happy - 1, 0.0, happy + 1, 0.0)


@pytest.mark.parametrize("guard", [GUARD_WASM, "native:concept_guard"], ids=["wasm", "native"])
def test_concept_guard_steers_against_its_concept_while_the_readout_is_above_the_threshold(runtime, guard):
    arg = {"concept": "happy", "threshold": 0.5, "scale": 6}
    assert bound(runtime, guard, 1, arg, **SCOPE)["readouts_on"] == [1]
    data, _ = mid(runtime, (1, None))
    assert data["seqs"]["1"]["error"] == "" and data["seqs"]["1"]["result"] is None
    steering, logs = [], []
    for happy in (0.25, 0.75, 1.5, 0.25, 0.0):
        reply = post(runtime, 1, readouts=[aici_wire.SeqReadout(id=1, values=readout(happy))])
        steering.append(reply["steering"])
        logs.append(reply["post_seqs"]["1"]["logs"])
    on = [{"id": 1, "terms": [{"vector": "concept:happy", "scale": -6.0}]}]
    assert steering == [[], on, [], [{"id": 1, "terms": []}], []]
    assert logs == ["concept_guard: 0.250000 off\n", "concept_guard: 0.750000 on\n", "concept_guard: 1.500000 on\n",
                    "concept_guard: 0.250000 off\n", "concept_guard: 0.000000 off\n"]
    assert post(runtime, 1, readouts=[])["post_seqs"]["1"]["result"] == {"stop": False}


@pytest.mark.parametrize("guard", [GUARD_WASM, "native:concept_guard"], ids=["wasm", "native"])
def test_concept_guard_stops_before_its_first_token_on_a_concept_not_read_out(runtime, guard):
    bound(runtime, guard, 1, {"concept": "angry", "threshold": 0.5, "scale": 6}, **SCOPE)
    data, _ = mid(runtime, (1, None))
    assert data["seqs"]["1"]["result"] == "Stop" and "no concept" in data["seqs"]["1"]["logs"]


def test_a_steering_set_in_mid_process_comes_back_in_its_reply(runtime):
    text = '[{"vector":"concept:sad","scale":3}]'
    steer = f"(drop (call $steer (i32.const 20000) (i32.const {len(text)})))"
    wasm = controller(mid=f"{steer} (call $ret_bias (i32.const 4096)) {ret_const(1300, MID_SAMPLE)}",
                      data=str_data(20000, text))
    start(runtime, wasm, 1, **SCOPE)
    data, _ = mid(runtime, (1, None))
    terms = [{"vector": "concept:sad", "scale": 3.0}]
    assert data["seqs"]["1"]["error"] == "" and data["steering"] == [{"id": 1, "terms": terms}]


def test_a_worker_that_reads_nothing_out_is_never_asked_for_readouts(runtime):
    wasm = controller(init_prompt=f"(drop (call $readout (i32.const 0) (i32.const 0))) {ret_const(1024, '{}')}",
                      post=f"(drop (call $readout (i32.const 0) (i32.const 0))) {POST_OK}")
    assert bound(runtime, wasm, 1, readout_layers=[3])["readouts_on"] == []
    assert post(runtime, 1)["readouts_on"] == []
