"""Prefill-only embedding requests (``Submit.outputs.pooling``): the pooled positions each chunk asks the worker
to sum, the embedding on the last event, the KV freed after, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest

from common import wire
from common.errors import INTERNAL_ERROR, INVALID_REQUEST, WireError
from common.pooling import vector_bytes, vector_of
from tests.scheduler.harness import Harness, prompt, seqs_of

NONE = {"tokens": wire.pack_tokens([-1]), "logprobs": wire.pack_logprobs([0.0])}
STATES = np.random.default_rng(1).standard_normal((40, 4)).astype(np.float32)  # the fake worker's hidden states


def run_embedding(h: Harness, rid: str, n: int, pooling: str) -> list[list[int]]:
    """Submit an embedding of ``n`` tokens and answer its steps as a worker does; returns each step's ``pool``."""
    h.submit(rid, prompt(n), 0, outputs=wire.OutputRequest(pooling=pooling))
    asked = []
    while rid in h.core.requests:
        (d,) = h.build()
        (seq,) = seqs_of([d], rid)
        assert not seq.sample and not seq.scores and not seq.readouts
        asked.append(seq.pool)
        pooled = {seq.seq_id: vector_bytes(STATES[seq.pool].sum(0))} if seq.pool else {}
        h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **NONE, pooled=pooled))
    return asked


@pytest.mark.parametrize(("pooling", "expected"), [("mean", STATES[:40].mean(0)), ("last", STATES[39])])
def test_the_embedding_comes_on_the_last_event(pooling, expected):
    h = Harness(prefill_chunk_tokens=16)
    h.worker()
    asked = run_embedding(h, "e", 40, pooling)
    assert asked == ([list(range(0, 16)), list(range(16, 32)), list(range(32, 40))] if pooling == "mean"
                     else [[], [], [39]])
    final = h.final("e")
    assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == ("length", 40, 0)
    np.testing.assert_allclose(vector_of(final.embedding), expected, rtol=1e-6, atol=1e-6)
    assert not any(o for e in h.events("e") for o in e.prompt_outputs)


def test_its_kv_is_freed_not_parked():
    h = Harness(prefill_chunk_tokens=16)
    h.worker()
    h.submit("e", prompt(20), 0, outputs=wire.OutputRequest(pooling="last"))
    (d,) = h.build()
    seq_id = seqs_of([d], "e")[0].seq_id
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **NONE))
    (d,) = h.build()
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **NONE, pooled={seq_id: vector_bytes(STATES[0])}))
    assert h.final("e").embedding and seq_id in h.core.to_free[b"w1"] and not h.core.sessions.parked


def test_refusals_and_a_worker_that_leaves_the_sum_out():
    h = Harness()
    h.worker()
    refused = h.submit("g", prompt(4), 3, outputs=wire.OutputRequest(pooling="mean"))
    assert isinstance(refused, wire.Error) and refused.code == INVALID_REQUEST and "prefill-only" in refused.message
    submit = wire.Submit(rid="x", prompt=b"", sampling=wire.SamplingParams(), max_tokens=0,
                         outputs=wire.OutputRequest(pooling="mean"))
    with pytest.raises(WireError, match="pooling"):  # a pooling the wire does not know is malformed
        wire.decode(wire.encode(submit).replace(b"mean", b"mode"))
    h.submit("e", prompt(4), 0, outputs=wire.OutputRequest(pooling="mean"))
    (d,) = h.build()
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **NONE))  # no pooled sum
    (failed,) = h.failures("e")
    assert failed.code == INTERNAL_ERROR and "pooled hidden states are malformed" in failed.message
