"""Pooling an embedding out of hidden states (common.pooling): positions, sums over prefill chunks, the unit
vector and OpenAI's encodings."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from common.pooling import PooledSum, encode, pooled_positions, unit, vector_bytes, vector_of

STATES = np.random.default_rng(0).standard_normal((11, 8)).astype(np.float32)  # [positions, hidden]


def test_pooled_positions():
    assert pooled_positions("last", 11) == range(10, 11)
    assert pooled_positions("mean", 11) == range(11)
    assert pooled_positions("last", 1) == range(1)


@pytest.mark.parametrize(("pooling", "expected"), [("last", STATES[-1]), ("mean", STATES.mean(0))])
def test_chunks_sums_add_up_to_the_pooled_vector(pooling, expected):
    positions = pooled_positions(pooling, len(STATES))
    pooled = PooledSum(positions)
    for start, end in ((0, 4), (4, 9), (9, 11)):  # three prefill chunks, as the worker sums each
        chunk = [p for p in positions if start <= p < end]
        if chunk:
            assert not pooled.complete
            pooled.add(vector_bytes(STATES[chunk].sum(0)), len(chunk))
    assert pooled.complete
    np.testing.assert_allclose(pooled.vector(), expected, rtol=1e-6, atol=1e-6)
    assert pooled.vector().dtype == np.float32


def test_a_missing_or_malformed_part_is_refused():
    pooled = PooledSum(range(3))
    with pytest.raises(ValueError, match="1 of 3"):
        pooled.add(vector_bytes(STATES[0]), 1)
        pooled.vector()
    with pytest.raises(ValueError, match="no pooled sum"):
        pooled.add(b"", 1)
    with pytest.raises(ValueError, match="not float32"):
        pooled.add(b"abc", 1)
    with pytest.raises(ValueError, match="3 values after ones of 8"):
        pooled.add(vector_bytes(STATES[0, :3]), 1)


def test_unit_and_encodings():
    v = unit(STATES[0])
    assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(v * np.linalg.norm(STATES[0]), STATES[0], rtol=1e-5)
    assert not unit(np.zeros(4, dtype=np.float32)).any()
    assert encode(v, "float") == v.tolist()
    raw = base64.b64decode(encode(v, "base64"))
    assert raw == v.astype("<f4").tobytes()  # little-endian float32, as OpenAI's base64
    np.testing.assert_array_equal(vector_of(raw), v)
