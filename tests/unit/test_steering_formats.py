"""Steering vectors: the canonical form and its id (common/steering.py), and the three upload formats read into it
(common/steering_formats.py): the same directions give the same id whichever format carried them, and every bad
file is a SteeringError saying what is wrong."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from common.steering import SteeringError, SteeringVector, decode, encode, vector_id
from common.steering_formats import detect, parse
from tests.steering_files import as_gguf, as_json

HIDDEN = 8
DIRECTIONS = {3: np.linspace(-1, 1, HIDDEN, dtype=np.float32), 1: np.arange(HIDDEN, dtype=np.float32) / 7}


def canonical_id(directions: dict[int, np.ndarray]) -> str:
    return vector_id(encode(SteeringVector(hidden_size=HIDDEN, directions=directions)))


# -- the canonical form ----------------------------------------------------------------------------


def test_the_canonical_form_round_trips_and_its_id_ignores_the_order_layers_came_in():
    vector = SteeringVector(hidden_size=HIDDEN, directions=DIRECTIONS)
    canonical = encode(vector)
    back = decode(canonical)
    assert back.layers == [1, 3] and all(np.array_equal(back.directions[k], DIRECTIONS[k]) for k in DIRECTIONS)
    assert vector_id(canonical) == canonical_id(dict(reversed(list(DIRECTIONS.items()))))
    assert len(vector_id(canonical)) == 64
    assert back.norms() == pytest.approx({k: float(np.linalg.norm(v)) for k, v in DIRECTIONS.items()})


def test_a_different_direction_is_a_different_id():
    other = {**DIRECTIONS, 1: DIRECTIONS[1] + np.float32(1e-3)}
    assert canonical_id(other) != canonical_id(DIRECTIONS)


@pytest.mark.parametrize("damage", [lambda b: b[:-1], lambda b: b"x" + b[1:], lambda b: b + b"\0\0\0\0"])
def test_decode_refuses_what_is_not_a_canonical_vector(damage):
    with pytest.raises(SteeringError):
        decode(damage(encode(SteeringVector(hidden_size=HIDDEN, directions=DIRECTIONS))))


# -- the three formats -----------------------------------------------------------------------------


def test_json_gguf_and_safetensors_of_the_same_directions_have_one_id(tmp_path: Path):
    uploads = {
        "json": as_json(DIRECTIONS),
        "gguf": as_gguf(tmp_path, {f"direction.{k}": v for k, v in DIRECTIONS.items()}),
        "safetensors": save({f"layers.{k}": v for k, v in DIRECTIONS.items()}),
    }
    ids = set()
    for kind, data in uploads.items():
        assert detect(data) == kind
        vector = parse(data)
        assert vector.hidden_size == HIDDEN and vector.layers == [1, 3]
        ids.add(vector_id(encode(vector)))
    assert ids == {canonical_id(DIRECTIONS)}


@pytest.mark.parametrize("name", ["3", "layers.3", "direction.3"])
def test_safetensors_names_a_layer_three_ways(name: str):
    assert parse(save({name: DIRECTIONS[3]})).layers == [3]


def test_gguf_direction_n_is_layer_n_and_direction_0_is_taken(tmp_path: Path):
    vector = parse(as_gguf(tmp_path, {"direction.0": DIRECTIONS[1], "direction.29": DIRECTIONS[3]}))
    assert vector.layers == [0, 29]


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"GGUF\x03\x00\x00\x00garbage", "not a readable GGUF file"),
    (b"not json at all", "not a GGUF control vector, a safetensors file or JSON"),
    (b'{"directions": {"1": [1, 2]}, "extra": 1}', "nothing else"),
    (b'{"directions": {}}', "at least one layer"),
    (b'{"directions": {"-1": [1.0]}}', "does not name a layer"),
    (b'{"directions": {"01": [1.0]}}', "does not name a layer"),
    (b'{"directions": {"1": [1.0, "x"]}}', "not a list of numbers"),
    (b'{"directions": {"1": [[1.0]]}}', "not a list of numbers"),
    (b'{"directions": {"1": [1.0, NaN]}}', "NaN or Inf"),
    (b'{"directions": {"1": [Infinity]}}', "NaN or Inf"),
    (b'{"directions": {"1": [1e39]}}', "too large for float32"),
    (b'{"directions": {"1": [1.0, 2.0], "2": [1.0]}}', "differ in length"),
    (b'{"directions": {"1": []}}', "not positive"),
    (b"[" * 100_000, "not a GGUF control vector"),
])
def test_bad_json_says_what_is_wrong(data: bytes, message: str):
    with pytest.raises(SteeringError, match=message):
        parse(data)


def test_bad_gguf_says_what_is_wrong(tmp_path: Path):
    good = {"direction.1": DIRECTIONS[1]}
    cases = [
        (as_gguf(tmp_path, good, arch="llama"), "must be a control vector"),
        (as_gguf(tmp_path, {"direction.1": DIRECTIONS[1].astype(np.float16)}), "F16; steering directions must be float32"),
        (as_gguf(tmp_path, {"direction.1": np.ones((2, HIDDEN), np.float32)}), "one flat"),
        (as_gguf(tmp_path, {"blk.1": DIRECTIONS[1]}), "does not name a layer"),
        (as_gguf(tmp_path, {"direction.1": np.array([1, np.nan], np.float32)}), "NaN or Inf"),
        (as_gguf(tmp_path, {"direction.1": np.ones(4, np.float32), "direction.2": np.ones(5, np.float32)}),
         "differ in length"),
        (as_gguf(tmp_path, {}), "at least one layer"),
    ]
    truncated = as_gguf(tmp_path, good)
    cases.append((truncated[: len(truncated) - 5], "not a readable GGUF file"))
    for data, message in cases:
        with pytest.raises(SteeringError, match=message):
            parse(data)


def test_bad_safetensors_says_what_is_wrong():
    header = json.dumps({"1": {"dtype": "F32", "shape": [HIDDEN], "data_offsets": [0, 4 * HIDDEN + 8]}}).encode()
    cases = [
        (save({"1": DIRECTIONS[1].astype(np.float64)}), "F64; steering directions must be float32"),
        (save({"1": np.ones((1, HIDDEN), np.float32)}), "one flat"),
        (save({"model.norm": DIRECTIONS[1]}), "does not name a layer"),
        (save({"1": np.array([np.inf, 1], np.float32)}), "NaN or Inf"),
        (save({"direction.1": DIRECTIONS[1], "1": DIRECTIONS[1]}), "appears twice"),
        (struct.pack("<Q", len(header)) + header + b"\0" * (4 * HIDDEN), "not a readable safetensors file"),
    ]
    for data, message in cases:
        with pytest.raises(SteeringError, match=message):
            parse(data)
