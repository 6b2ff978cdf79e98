"""Followers: the decoding sequences every step of their worker carries in ``Step.follows`` (packed ids, no
SeqStep), their results read in slot order; when they join, when they leave, and what a step in flight
or a restarted worker does to them."""

from collections import deque

from common import wire
from tests.scheduler.harness import EOS, HE, WOR, Harness, followed, prompt, seqs_of


def following(*rids: str) -> Harness:
    """One worker whose requests ``rids`` (10 tokens each) sampled their first token, 3: they follow."""
    h = Harness()
    h.worker()
    for i, rid in enumerate(rids):
        h.submit(rid, prompt(3 + i), 10)
    h.cycle()
    return h


def pipelined(h: Harness, tokens: dict[str, int], until: set[str], *, max_steps: int = 100) -> dict[str, int]:
    """Run steps as the service does at pipeline depth 2 (build while the oldest runs, apply it, work out
    the text) until the requests of ``until`` ended, each sampling its token of ``tokens``; how many
    slots sampled for each request."""
    in_flight: deque[list] = deque()
    slots = dict.fromkeys(tokens, 0)
    for _ in range(max_steps):
        if not until & set(h.core.requests):
            return slots
        steps = h.build()
        for d in steps:
            for request in d.followers:
                slots[request.rid] += 1
            for owner, seq in d.batch:
                slots[owner.rid] += seq.sample or seq.follow
        if steps:
            in_flight.append(steps)
        if in_flight and (not steps or len(in_flight) == 2):
            h.apply(in_flight.popleft(), tokens)
            h.core.emit_deferred()
    raise AssertionError("the requests did not end")


def test_a_request_follows_from_its_first_sample_and_is_never_sampled_past_its_limit():
    h = Harness()
    h.worker()
    h.submit("r", prompt(3), 4)
    h.submit("one", prompt(4), 1)
    first = h.build()
    second = h.build()
    assert followed(second, "r") and not followed(second, "one")  # one token: nothing to follow
    h.apply(first, {"r": 21, "one": 22})
    h.apply(second, {"r": 21})
    slots = pipelined(h, {"r": 21}, {"r"})
    assert h.generated("r") == [21] * 4 and h.final("r").finish_reason == "length"
    assert slots["r"] + 2 == 4  # the worker sampled it exactly 4 times in all
    assert h.generated("one") == [22]


def test_each_follower_gets_its_own_tokens_as_requests_join_end_and_fail():
    """Slots map to requests by position only: tokens must reach the request whose slot they fill while
    followers join at different steps, end, are cancelled and fail with steps in flight."""
    h = Harness()
    h.worker()
    tokens = {rid: 20 + i for i, rid in enumerate("abcdef")}
    for rid, n in zip("abc", (12, 5, 9)):
        h.submit(rid, prompt(3 + len(rid)), n)
    first = h.build()
    h.submit("d", prompt(30), 10)
    second = h.build()
    h.apply(first, tokens)
    h.core.control(b"gw", wire.Cancel(rid="b"))
    h.submit("e", prompt(7), 6)
    third = h.build()
    h.apply(second, tokens)
    h.apply(third, tokens, failures={"c": "KV cache exhausted"})
    h.submit("f", prompt(2), 4)
    pipelined(h, tokens, {"a", "d", "e", "f"})
    for rid, n in zip("adef", (12, 10, 6, 4)):
        assert h.generated(rid) == [tokens[rid]] * n, rid
    assert h.final("b").finish_reason == "cancelled" and len(h.generated("b")) <= 2
    assert "KV cache exhausted" in h.failures("c")[0].message


def test_a_follower_cancelled_with_steps_in_flight_is_dropped_from_them_and_freed():
    h = following("a", "b")
    first, second = h.build(), h.build()
    assert followed(second, "a") and followed(second, "b")
    seq_a = h.core.requests["a"].seq_id
    h.core.control(b"gw", wire.Cancel(rid="a"))
    h.apply(first, {"a": 21, "b": 22})  # a's sample is dropped
    (third,) = h.build()
    assert third.step.free == [seq_a] and third.step.slot_ids() == [h.core.requests["b"].seq_id]
    h.apply(second, {"a": 21, "b": 22})
    h.core.emit_deferred()
    assert h.generated("a") == [3] and h.final("a").finish_reason == "cancelled"
    assert h.generated("b") == [3, 22, 22]


def test_a_paused_follower_leaves_and_feeds_its_last_token_when_resumed():
    h = following("r")
    first = h.build()
    h.core.control(b"gw", wire.Pause(rid="r"))
    assert h.build() == []
    h.apply(first, {"r": 22})  # the step in flight still samples it
    assert h.build() == []
    h.core.control(b"gw", wire.Resume(rid="r"))
    resumed = h.build()
    (seq,) = seqs_of(resumed, "r")
    assert seq.tokens == [22] and not seq.follow
    h.apply(resumed, {"r": 23})
    h.core.emit_deferred()
    assert followed(h.build(), "r") and h.generated("r") == [3, 22, 23]


def test_a_restarted_worker_is_sent_full_steps_and_stale_results_change_nothing():
    h = following("a")
    first, second = h.build(), h.build()
    assert followed(second, "a")
    h.core.worker_hello(b"w1", wire.WorkerHello(worker_id="w1", stage="ready", vocab_size=64, max_model_len=2048,
                                                eos_token_ids=[EOS], kv_capacity_tokens=4096, incarnation="new",
                                                wire_version=wire.WIRE_VERSION))
    assert h.failures("a")[0].code == "service_unavailable"
    h.submit("b", prompt(3), 10)
    (fresh,) = h.build()
    assert fresh.step.free_all and fresh.step.follows == b"" and [o.rid for o, _ in fresh.batch] == ["b"]
    h.apply(first)  # the lost life's results, applied late
    h.apply(second)
    assert len(h.build()) == 1  # b follows: a second step in flight, the stale results took no room
    assert "a" not in h.core.requests and h.generated("a") == [3]


def test_a_turn_parks_what_its_sequence_holds_at_pipeline_depth_one():
    """Without a step in flight a follow feeds the token the scheduler saw last: the parked sequence
    holds every token but the last sampled."""
    h = Harness(pipeline_depth=1)
    h.worker()
    h.submit("t1", prompt(3), 5, session=wire.SessionRef(key="s1"))
    h.cycle({"t1": HE})
    assert followed(h.cycle({"t1": EOS}), "t1")
    assert h.core.sessions.parked["s1"].tokens().tolist() == prompt(3) + [HE]
    h.submit("t2", prompt(3) + [HE, WOR], 2, session=wire.SessionRef(key="s1"))
    (seq,) = seqs_of(h.build(), "t2")
    assert (seq.backtrack, seq.tokens) == (0, [WOR])
