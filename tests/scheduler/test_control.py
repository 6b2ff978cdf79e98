"""Cancel, pause, resume and modify: queued, between steps, and while a step of the request is in flight."""

from common import wire
from common.errors import INVALID_REQUEST
from services.scheduler.requests import State
from tests.scheduler.harness import EOS, HE, LLO, Harness, prompt, seqs_of


def running(h: Harness, rid: str = "r", max_tokens: int = 10, **fields: object) -> Harness:
    h.worker()
    h.submit(rid, prompt(3), max_tokens, **fields)
    h.cycle({rid: HE})
    return h


def test_cancel_a_queued_request():
    h = Harness()
    h.submit("r", prompt(3))
    reply = h.core.control(b"gw", wire.Cancel(rid="r"))
    assert reply == wire.RequestState(rid="r", state="finished", paused=False)
    assert h.final("r").finish_reason == "cancelled" and not h.core.queue


def test_cancel_between_steps_frees_the_sequence():
    h = running(Harness())
    seq_id = h.core.requests["r"].seq_id
    h.core.control(b"gw", wire.Cancel(rid="r"))
    assert h.final("r").finish_reason == "cancelled" and h.final("r").completion_tokens == 1
    assert h.build()[0].step.free == [seq_id]
    assert h.core.pool.workers[b"w1"].reserved_tokens == 0


def test_cancel_while_its_step_runs_drops_the_result():
    h = running(Harness())
    steps = h.build()
    h.core.control(b"gw", wire.Cancel(rid="r"))
    h.apply(steps, {"r": LLO})
    h.core.emit_deferred()
    assert h.generated("r") == [HE] and h.final("r").finish_reason == "cancelled"


def test_cancel_with_two_steps_in_flight():
    h = running(Harness())
    first, second = h.build(), h.build()
    h.apply(first, {"r": LLO})
    h.core.control(b"gw", wire.Cancel(rid="r"))
    h.apply(second, {"r": HE})
    h.core.emit_deferred()
    assert h.generated("r") == [HE, LLO] and h.text("r") == " hello"
    assert h.final("r").finish_reason == "cancelled"


def test_a_paused_request_is_not_stepped_and_resumes_where_it_was():
    h = running(Harness())
    reply = h.core.control(b"gw", wire.Pause(rid="r"))
    assert reply == wire.RequestState(rid="r", state="running", paused=True)
    assert h.build() == []
    h.core.control(b"gw", wire.Resume(rid="r"))
    (seq,) = seqs_of(h.build(), "r")
    assert seq.tokens == [HE]


def test_pause_while_a_step_runs_applies_its_result_then_stops():
    h = running(Harness())
    steps = h.build()
    h.core.control(b"gw", wire.Pause(rid="r"))
    assert h.build() == []  # no follow for a paused request
    h.apply(steps, {"r": LLO})
    h.core.emit_deferred()
    assert h.generated("r") == [HE, LLO] and h.build() == []


def test_modify_sampling_is_sent_with_the_next_step():
    h = running(Harness())
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(temperature=0.5, top_k=4)))
    (seq,) = seqs_of(h.build(), "r")
    assert seq.sampling is not None and (seq.sampling.temperature, seq.sampling.top_k) == (0.5, 4)


def test_modify_while_a_step_runs_goes_with_the_follow_step():
    h = running(Harness())
    h.build()
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(seed=7)))
    (seq,) = seqs_of(h.build(), "r")
    assert seq.follow and seq.sampling is not None and seq.sampling.seed == 7


def test_modify_max_tokens_below_what_was_generated_ends_the_request():
    h = running(Harness())
    h.cycle({"r": LLO})
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(max_tokens=2)))
    assert h.final("r").finish_reason == "length" and h.final("r").completion_tokens == 2


def test_modify_max_tokens_beyond_the_context_is_refused_and_changes_nothing():
    h = Harness()
    h.worker(max_model_len=20)
    h.submit("r", prompt(3), 10)
    h.cycle({"r": HE})
    reply = h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(max_tokens=18, temperature=0.9)))
    assert isinstance(reply, wire.Error) and reply.code == "context_length_exceeded" and "at most 17" in reply.message
    assert h.core.requests["r"].submit.max_tokens == 10 and h.core.requests["r"].submit.sampling.temperature == 0.0


def test_modify_max_tokens_of_a_queued_request():
    h = Harness()
    h.submit("r", prompt(3), 10)
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(max_tokens=1)))
    h.worker()
    h.run({"r": [HE, LLO]})
    assert h.generated("r") == [HE] and h.final("r").finish_reason == "length"


def test_modify_stop_strings_applies_to_the_text_to_come():
    h = running(Harness())
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(stop=["llo"])))
    h.run({"r": [LLO, EOS]})
    assert h.final("r").stop_reason == "llo" and h.text("r") == " he"


def test_control_of_an_unknown_or_foreign_request_is_refused():
    h = running(Harness())
    for gateway, rid in ((b"gw", "nope"), (b"other", "r")):
        reply = h.core.control(gateway, wire.Cancel(rid=rid))
        assert isinstance(reply, wire.Error) and reply.code == INVALID_REQUEST and reply.rid == rid
    assert h.core.requests["r"].state is State.RUNNING


def test_a_lost_gateway_cancels_its_requests_only():
    h = Harness()
    h.worker()
    h.submit("a", prompt(3), gateway=b"g1")
    h.submit("b", prompt(3), gateway=b"g2")
    h.cycle()
    assert h.core.gateway_lost(b"g1") == 1
    assert h.final("a").finish_reason == "cancelled" and "b" in h.core.requests
