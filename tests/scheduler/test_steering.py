"""A request's activation steering on its way to the worker (docs/steering.md): the scheduler only carries it."""

from __future__ import annotations

from common import wire
from tests.scheduler.harness import Harness, followed, prompt, seqs_of

TERM = wire.SteeringTerm(vector="v1", scale=2.0, layers=[1], positions="generated")
OTHER = wire.SteeringTerm(vector="concept:sky", scale=-1.0)


def _steered(h: Harness, rid: str = "r", max_tokens: int = 8) -> None:
    h.submit(rid, prompt(3), max_tokens, steering=[TERM], steering_vectors={"v1": b"canonical v1"},
             cache_domain="d")


def test_the_steering_and_its_vectors_go_with_the_first_seqstep_only():
    h = Harness()
    h.worker()
    _steered(h)
    h.submit("plain", prompt(4), 8)
    first = h.cycle()
    (seq,) = seqs_of(first, "r")
    assert seq.steering == [TERM] and seq.vectors == {"v1": b"canonical v1"}
    (plain,) = seqs_of(first, "plain")
    assert plain.steering is None and not plain.vectors
    later = h.cycle()
    assert followed(later, "r") and not seqs_of(later, "r")  # decoding on: a follower, no SeqStep of its own


def test_a_modify_sends_the_new_steering_with_the_next_token_and_makes_the_domain_its_own():
    h = Harness()
    h.worker()
    _steered(h, max_tokens=20)
    h.cycle()
    assert followed(h.cycle(), "r")
    reply = h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(steering=[TERM, OTHER])))
    assert isinstance(reply, wire.RequestState)
    (seq,) = seqs_of(h.cycle(), "r")
    assert seq.steering == [TERM, OTHER] and seq.vectors == {"v1": b"canonical v1"}  # v1 still named: kept
    request = h.core.requests["r"]
    assert request.submit.cache_domain != "d" and request.submit.cache_domain.startswith("d|")
    # the same steering again changes nothing: no SeqStep carries it, the domain stays
    domain = request.submit.cache_domain
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(steering=[TERM, OTHER])))
    assert request.submit.cache_domain == domain and not request.steering_dirty


def test_a_modify_that_ends_the_steering_sends_an_empty_one_and_drops_the_vectors():
    h = Harness()
    h.worker()
    _steered(h, max_tokens=20)
    h.cycle()
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(steering=[])))
    (seq,) = seqs_of(h.cycle(), "r")
    assert seq.steering == [] and seq.vectors == {}


def test_residuals_of_prompt_positions_come_back_as_prompt_outputs():
    h = Harness(prefill_chunk_tokens=16)
    h.worker()
    ids = prompt(20)
    outputs = wire.OutputRequest(residual_ranges=[wire.PositionSpan(19, 20)], residual_layers=[0, 2])
    h.submit("r", ids, 0, outputs=outputs)
    (d,) = h.build()
    (seq,) = d.batch[0][1:]
    assert seq.residuals == [] and len(seq.tokens) == 16
    none = {"tokens": wire.pack_tokens([-1]), "logprobs": wire.pack_logprobs([0.0])}
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **none))
    (d,) = h.build()
    (seq,) = d.batch[0][1:]
    assert seq.residuals == [19] and seq.residual_layers == [0, 2]
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **none,
                                    residuals={seq.seq_id: [wire.ReadoutResult(19, b"h19")]}))
    (out,) = [o for e in h.events("r") for o in e.prompt_outputs]
    assert out.position == 19 and out.residual == b"h19" and out.readout == b""
    assert h.final("r").finish_reason == "length"
