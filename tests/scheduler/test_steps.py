"""Building steps: chunked prefill, the token budget, decode-first order, pipelining with ``follow``, and
the followers every step carries (``Step.follows``) with their results in slot order."""

import pytest

from common import wire
from common.errors import SERVICE_UNAVAILABLE
from tests.scheduler.harness import EOS, HE, LD, LLO, VOCAB, WOR, Harness, followed, prompt, seqs_of


def test_a_long_prompt_is_fed_in_chunks_and_sampled_after_the_last():
    h = Harness(prefill_chunk_tokens=16)
    h.worker()
    ids = prompt(40)
    h.submit("r", ids, 4)
    fed = []
    for _ in range(3):
        (seq,) = seqs_of(h.cycle(), "r")
        fed.append((seq.tokens, seq.sample))
    assert fed == [(ids[:16], False), (ids[16:32], False), (ids[32:], True)]
    assert len(h.generated("r")) == 1


def test_the_step_token_budget_caps_prefill_and_decoding_goes_first():
    h = Harness(prefill_chunk_tokens=16, step_token_budget=20)
    h.worker()
    h.submit("old", prompt(5), 8)
    h.cycle()  # "old" is decoding from now on
    h.submit("new1", prompt(16), 4)
    h.submit("new2", prompt(16), 4)
    (step,) = h.build()
    seqs = step.step.seqs
    assert step.step.slot_ids()[0] == h.core.requests["old"].seq_id  # it follows: 1 decode token
    assert [len(s.tokens) for s in seqs] == [16, 3]  # then prompts within 20 tokens
    assert not seqs[1].sample


def test_sampling_params_go_with_the_first_seqstep_only():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 5, sampling=wire.SamplingParams(temperature=0.7, seed=3))
    (first,) = seqs_of(h.cycle(), "r")
    second = h.cycle()
    assert first.sampling == wire.SamplingParams(temperature=0.7, seed=3)
    assert followed(second, "r") and not seqs_of(second, "r")  # a follower: no SeqStep, the worker's parameters


def test_a_decoding_request_follows_its_sample_from_then_on():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 5)
    h.cycle({"r": 21})
    step = h.cycle({"r": 22})
    assert followed(step, "r") and step[0].step.slot_ids() == [h.core.requests["r"].seq_id]
    assert followed(h.build(), "r") and h.generated("r") == [21, 22]


def test_pipelining_sends_a_follow_step_before_the_result_is_back():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10)
    first = h.build()
    second = h.build()  # the first is still in flight
    assert followed(second, "r") and not seqs_of(second, "r")
    assert h.build() == []  # never more than limits.pipeline_depth steps in flight
    h.apply(first, {"r": 21})
    h.apply(second, {"r": 22})
    h.core.emit_deferred()
    assert h.generated("r") == [21, 22]
    assert followed(h.build(), "r")  # the worker feeds 22 itself


def test_no_follow_when_the_token_in_flight_is_the_last():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 1)
    h.build()
    assert h.build() == []


def test_no_follow_when_the_token_in_flight_fills_the_context():
    h = Harness()
    h.worker(max_model_len=20)
    h.submit("r", prompt(19), 16)
    h.build()
    assert h.build() == []


def test_a_prompt_chunk_does_not_wait_for_the_chunk_before():
    h = Harness(prefill_chunk_tokens=16)
    h.worker()
    ids = prompt(40)
    h.submit("r", ids, 4)
    first, second = h.build(), h.build()
    assert seqs_of(first, "r")[0].tokens == ids[:16] and seqs_of(second, "r")[0].tokens == ids[16:32]


def test_the_sample_after_eos_is_dropped():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10)
    h.cycle({"r": 21})
    first = h.build()
    second = h.build()  # follows the token the first step samples
    h.apply(first, {"r": EOS})
    h.apply(second, {"r": 22})  # sampled after EOS: never shown
    h.core.emit_deferred()
    assert h.generated("r") == [21, EOS]
    final = h.final("r")
    assert final.finish_reason == "stop" and final.stop_reason == EOS and final.completion_tokens == 2
    seq_id = first[0].step.slot_ids()[0]
    assert seq_id in h.build()[0].step.free  # the worker's sequence is freed with the next step


def test_the_sample_after_a_stop_string_is_dropped():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 10, stop=["llo wor"])
    h.cycle({"r": 6})  # " he"
    first = h.build()
    h.apply(first, {"r": LLO})
    second = h.build()  # its text is worked out while this one runs
    h.core.emit_deferred()
    h.apply(second, {"r": WOR})
    h.core.emit_deferred()
    third = h.build()
    h.apply(third, {"r": LD})  # the stop string completed on " wor": "ld" never shows
    h.core.emit_deferred()
    assert h.final("r").finish_reason == "stop" and h.final("r").stop_reason == "llo wor"
    assert h.text("r") == " he"
    assert LD not in h.generated("r")


def test_a_failed_sequence_fails_its_request_only():
    h = Harness()
    h.worker()
    h.submit("ok", prompt(3), 3)
    h.submit("bad", prompt(3), 3)
    h.cycle(failures={"bad": "out of blocks"})
    (failed,) = h.failures("bad")
    assert failed.code == "internal_error" and "out of blocks" in failed.message
    assert "ok" in h.core.requests and "bad" not in h.core.requests
    assert h.core.requests["ok"].seq_id not in h.build()[0].step.free


def test_a_missing_sample_fails_the_request():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 3)
    (d,) = h.build()
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, tokens=wire.pack_tokens([-1]),
                                    logprobs=wire.pack_logprobs([0.0])))
    assert "no token" in h.failures("r")[0].message


def test_a_result_that_does_not_fit_its_step_drops_its_worker():
    """A worker whose result does not answer its step (broken, or speaking another wire) is dropped: its
    requests fail as a lost worker's do (retryable), and new ones wait for a worker that works."""
    h = Harness()
    h.worker()
    for rid in ("a", "b"):
        h.submit(rid, prompt(3), 8)
    h.cycle()
    h.submit("c", prompt(3), 8)
    (d,) = h.build()  # a and b follow, c's prompt
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, tokens=wire.pack_tokens([5, 6]),
                                    logprobs=wire.pack_logprobs([0.0, 0.0])))
    for rid in ("a", "b", "c"):
        (failed,) = h.failures(rid)
        assert failed.code == SERVICE_UNAVAILABLE and failed.recoverable and failed.recovery_action == "retry"
        assert "its step result does not fit the step: 2 slots, the step has 3" in failed.message
    assert h.core.pool.workers == {}
    h.submit("d", prompt(3), 8)
    assert h.build() == []  # nothing goes to the dropped worker
    h.worker(b"w2")
    h.cycle()
    assert len(h.generated("d")) == 1


@pytest.mark.parametrize("tokens, top, expected", [
    ([len(VOCAB)], {}, f"sampled token ids [{len(VOCAB)}] outside the vocabulary of {len(VOCAB)}"),
    ([-7], {}, f"sampled token ids [-7] outside the vocabulary of {len(VOCAB)}"),
    ([5], {3: [wire.TokenLogprob(5, 0.0)]}, "top alternatives for slots [3] of 1"),
    ([5], {0: [wire.TokenLogprob(10**6, 0.0)]}, f"top alternatives outside the vocabulary of {len(VOCAB)}"),
])
def test_token_ids_the_step_cannot_have_drop_the_worker(tokens, top, expected) -> None:
    """Sampled tokens past the vocabulary (they came back as empty text, the request a success) or alternatives
    for slots the step does not have: the worker is broken, its requests fail retryable, other workers go on."""
    h = Harness()
    h.worker(b"bad")
    h.submit("r", prompt(3), 8)
    (d,) = h.build()
    h.worker(b"good")
    h.submit("other", prompt(3), 8)
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, tokens=wire.pack_tokens(tokens),
                                    logprobs=wire.pack_logprobs([0.0] * len(tokens)), top=top))
    (failed,) = h.failures("r")
    assert failed.code == SERVICE_UNAVAILABLE and expected in failed.message
    assert list(h.core.pool.workers) == [b"good"]
    h.run({"other": [HE]})
    assert h.final("other").finish_reason == "length" and h.generated("other")[0] == HE


def test_events_of_one_step_go_to_each_gateway_in_one_message():
    h = Harness()
    h.worker()
    h.submit("a", prompt(3), 5, gateway=b"g1")
    h.submit("b", prompt(3), 5, gateway=b"g1")
    h.submit("c", prompt(3), 5, gateway=b"g2")
    h.cycle()
    out = h.take()
    assert sorted(g for g, _ in out) == [b"g1", b"g2"]
    by_gateway = {g: m for g, m in out}
    assert sorted(e.rid for e in by_gateway[b"g1"].token_events()) == ["a", "b"]


def test_prompt_logprobs_and_readouts_come_back_as_prompt_outputs():
    h = Harness(prefill_chunk_tokens=16)
    h.worker()
    ids = prompt(20)
    outputs = wire.OutputRequest(logprob_ranges=[wire.PositionSpan(1, 20)], top_logprobs=2,
                                 readout_ranges=[wire.PositionSpan(18, 20)])
    h.submit("r", ids, 0, outputs=outputs)
    (d,) = h.build()
    (seq,) = d.batch[0][1:]
    assert [s.position for s in seq.scores] == list(range(0, 16)) and seq.top_logprobs == 2
    none = {"tokens": wire.pack_tokens([-1]), "logprobs": wire.pack_logprobs([0.0])}
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **none,
                                    scores={seq.seq_id: [wire.ScoreResult(p, ids[p + 1], -1.0) for p in range(16)]}))
    (d,) = h.build()
    (seq,) = d.batch[0][1:]
    assert seq.readouts == [18, 19] and not seq.sample
    h.core.apply(d, wire.StepResult(step_id=d.step.step_id, **none,
                                    scores={seq.seq_id: [wire.ScoreResult(p, ids[p + 1], -2.0) for p in range(16, 19)]},
                                    readouts={seq.seq_id: [wire.ReadoutResult(18, b"r18"), wire.ReadoutResult(19, b"r19")]}))
    positions = [o for e in h.events("r") for o in e.prompt_outputs]
    assert [o.position for o in positions] == list(range(1, 20))
    assert positions[-1].readout == b"r19" and positions[-1].logprob == -2.0
    assert h.final("r").finish_reason == "length" and h.final("r").completion_tokens == 0


def test_prompt_order_follows_priority_as_requests_come_and_go():
    """Each worker's SeqSteps go in priority, then arrival order, as requests are admitted and end
    between steps, not only for the requests of the first step; followers go first."""
    h = Harness(prefill_chunk_tokens=16, step_token_budget=18)
    h.worker()
    h.submit("a", prompt(3), 2)
    h.submit("b", prompt(40), 8, priority=5)
    h.cycle()  # a's prompt and 15 of b's
    h.submit("c", prompt(40), 8, priority=1)
    h.cycle()  # a samples its last token (it follows), then c's first chunk goes before b's
    (step,) = h.build()
    ids = {rid: h.core.requests[rid].seq_id for rid in ("b", "c")}
    assert "a" not in h.core.requests
    assert [(s.seq_id, len(s.tokens)) for s in step.step.seqs] == [(ids["c"], 16), (ids["b"], 2)]


def test_a_modified_sampling_goes_with_the_next_follow_only():
    """A follower leaves the followers to carry new sampling parameters in a follow SeqStep, and joins
    them again."""
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 20)
    h.cycle()
    first = h.build()
    second = h.build()
    h.core.control(b"gw", wire.Modify(rid="r", patch=wire.SamplingPatch(temperature=0.5)))
    h.apply(first)
    third = h.build()
    h.apply(second)
    fourth = h.build()
    (seq,) = seqs_of(third, "r")
    assert seq.follow and seq.sampling is not None and seq.sampling.temperature == 0.5
    assert [followed(steps, "r") for steps in (first, second, third, fourth)] == [True, True, False, True]


def _walks(name: str):
    def walk(self: "Watched"):
        self.walked = True
        return getattr(dict, name)(self)
    return walk


def _reads(name: str):
    def read(self: "Watched", key, *default):
        self.read.add(key)
        return getattr(dict, name)(self, key, *default)
    return read


class Watched(dict):
    """A table that records the keys read one by one, and whether it was walked whole."""

    def __init__(self, table: dict) -> None:
        super().__init__(table)
        self.read: set = set()
        self.walked = False

    get, __getitem__, __contains__ = (_reads(name) for name in ("get", "__getitem__", "__contains__"))
    __iter__, keys, values, items = (_walks(name) for name in ("__iter__", "keys", "values", "items"))


def test_building_steps_visits_only_the_workers_with_work():
    h = Harness()
    idle = [h.worker(f"w{i}".encode()) for i in range(1000)]
    for i in range(500):  # half the idle workers ran a request, ended and freed since
        h.submit(f"done{i}", prompt(3), 1)
    h.cycle()
    h.cycle()
    assert not h.core.requests and not h.core.to_free
    h.submit("r", prompt(3), 8)
    h.core.admit()
    busy = h.core.requests["r"].worker
    state = h.core.state
    assert len(state.batches) > 1  # the batches of the idle workers that ran a request are still there
    for roomy in (None, set(idle)):  # all workers, or those the shell says have room
        workers = state.pool.workers = Watched(state.pool.workers)
        batches = state.batches = Watched(state.batches)
        steps = h.core.build_steps(None, roomy)
        assert [d.worker for d in steps] == [busy] and (seqs_of(steps, "r") or followed(steps, "r"))
        assert workers.read == batches.read == {busy} and not workers.walked and not batches.walked
        h.apply(steps)
