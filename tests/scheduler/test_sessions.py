"""Session turns: parking a finished turn's KV, continuing from it, forks of it, budgets and eviction."""

from common import wire
from common.config import Sessions
from services.scheduler.sessions import UNSEEN
from tests.scheduler.harness import EOS, HE, LLO, WOR, Harness, followed, prompt, seqs_of


def turn(h: Harness, rid: str, ids: list[int], key: str = "s1", parent: str = "", max_tokens: int = 2,
         tokens: tuple[int, ...] = (HE, LLO)) -> list[int]:
    """Run one session turn to its end; the tokens the session holds after it."""
    h.submit(rid, ids, max_tokens, session=wire.SessionRef(key=key, parent=parent))
    h.run({rid: list(tokens)})
    return ids + h.generated(rid)


def test_a_finished_turn_parks_its_sequence_instead_of_freeing_it():
    h = Harness()
    h.worker()
    turn(h, "t1", prompt(5))
    facts = h.core.facts()
    assert (facts.parked_sessions, facts.parked_tokens) == (1, 6)  # the last token was never fed
    assert all(not d.step.free for d in h.build())
    assert h.core.pool.workers[b"w1"].reserved_tokens == 16  # its 6 tokens' whole block


def test_the_next_turn_continues_the_parked_sequence():
    h = Harness()
    h.worker()
    history = turn(h, "t1", prompt(5))
    seq_id = h.final("t1") and h.core.sessions.parked["s1"].seq_id
    h.submit("t2", history + [WOR], 2, session=wire.SessionRef(key="s1"))
    (seq,) = seqs_of(h.build(), "t2")
    assert seq.seq_id == seq_id and seq.tokens == [LLO, WOR] and seq.backtrack == 0 and seq.fork_of is None
    assert h.core.requests["t2"].cached_tokens == 6


def test_a_turn_that_rewrites_history_backtracks_the_parked_sequence():
    h = Harness()
    h.worker()
    history = turn(h, "t1", prompt(5))
    h.submit("t2", history[:3] + [WOR], 2, session=wire.SessionRef(key="s1"))
    (seq,) = seqs_of(h.build(), "t2")
    assert seq.backtrack == 3 and seq.tokens == [WOR]


def test_a_session_turn_follows_and_parks_the_token_its_follow_step_fed():
    h = Harness()
    h.worker()
    h.submit("t1", prompt(3), 5, session=wire.SessionRef(key="s1"))
    first, second = h.build(), h.build()
    assert followed(second, "t1")
    h.apply(first, {"t1": HE})
    third = h.build()  # follows the second, whose token ends the turn
    h.apply(second, {"t1": EOS})
    assert h.final("t1").finish_reason == "stop"
    # the third step feeds EOS: the sequence holds it, and the next turn backtracks over it
    assert h.core.sessions.parked["s1"].tokens().tolist() == prompt(3) + [HE, EOS]
    h.apply(third)
    h.submit("t2", prompt(3) + [HE, WOR], 2, session=wire.SessionRef(key="s1"))
    (seq,) = seqs_of(h.build(), "t2")
    assert (seq.backtrack, seq.tokens) == (1, [WOR]) and h.core.requests["t2"].cached_tokens == 4


def test_a_turn_ended_by_a_stop_string_parks_the_unseen_token_its_follow_step_fed():
    h = Harness()
    h.worker()
    h.submit("t1", prompt(3), 8, session=wire.SessionRef(key="s1"), stop=["llo"])
    first, second = h.build(), h.build()
    h.apply(first, {"t1": HE})
    third = h.build()
    h.apply(second, {"t1": LLO})
    fourth = h.build()  # feeds what the third samples, a token the scheduler never sees
    h.core.emit_deferred()  # " hello": the stop string ends the turn
    assert h.final("t1").finish_reason == "stop"
    assert h.core.sessions.parked["s1"].tokens().tolist() == prompt(3) + [HE, LLO, UNSEEN]
    h.apply(third)
    h.apply(fourth)
    h.submit("t2", prompt(3) + [HE, LLO, WOR], 2, session=wire.SessionRef(key="s1"))
    (seq,) = seqs_of(h.build(), "t2")
    assert (seq.backtrack, seq.tokens) == (1, [WOR])


def test_a_turn_reading_out_decoded_positions_never_follows():
    h = Harness()
    h.worker()
    h.submit("t1", prompt(3), 5, session=wire.SessionRef(key="s1"),
             outputs=wire.OutputRequest(readout_ranges=[wire.PositionSpan(3, 8)]))
    h.build()
    assert h.build() == []


def test_a_forked_session_forks_the_parents_parked_kv():
    h = Harness()
    h.worker()
    history = turn(h, "t1", prompt(5))
    parent_seq = h.core.sessions.parked["s1"].seq_id
    h.submit("f1", history + [WOR], 2, session=wire.SessionRef(key="s2", parent="s1"))
    steps = h.build()
    (seq,) = seqs_of(steps, "f1")
    assert seq.fork_of == parent_seq and seq.seq_id != parent_seq and seq.tokens == [LLO, WOR]
    assert parent_seq in h.core.sessions.pinned
    h.core.drop_session("s1")  # pinned: the parent stays until the fork is copied
    assert "s1" in h.core.sessions.parked
    h.apply(steps)
    assert parent_seq not in h.core.sessions.pinned


def test_closing_a_session_frees_its_parked_kv_and_cancels_its_turn():
    h = Harness()
    h.worker()
    history = turn(h, "t1", prompt(5))
    parked = h.core.sessions.parked["s1"].seq_id
    h.core.drop_session("s1")
    assert not h.core.sessions.parked and parked in h.build()[0].step.free
    h.submit("t2", history, 4, session=wire.SessionRef(key="s1"))
    h.cycle()
    h.core.drop_session("s1")
    assert h.final("t2").finish_reason == "cancelled" and not h.core.sessions.parked


def test_a_session_over_its_kv_budget_is_not_kept():
    h = Harness(sessions=Sessions(kv_tokens_per_session=4))
    h.worker()
    turn(h, "t1", prompt(5))
    assert not h.core.sessions.parked
    assert h.core.pool.workers[b"w1"].reserved_tokens == 0


def test_a_live_request_evicts_idle_sessions_when_it_needs_the_room():
    h = Harness()
    h.worker(capacity=70)
    turn(h, "t1", prompt(10), key="s1")
    turn(h, "t2", prompt(10, start=20), key="s2")
    assert h.core.pool.workers[b"w1"].reserved_tokens == 32  # 11 tokens each, in whole 16-token blocks
    h.submit("big", prompt(10), 30)  # 48 (40 tokens) of the 38 unreserved: the least recently parked session goes
    h.build()
    assert list(h.core.sessions.parked) == ["s2"]
    assert h.core.requests["big"].worker == b"w1" and h.core.pool.workers[b"w1"].reserved_tokens == 64


def test_idle_sessions_hold_at_most_their_share_of_the_pool():
    h = Harness()  # kv_parked_fraction 0.5
    h.worker(capacity=40)
    turn(h, "t1", prompt(10), key="s1")
    turn(h, "t2", prompt(10, start=20), key="s2")  # 22 > 20: the older one goes
    assert list(h.core.sessions.parked) == ["s2"]


def test_parked_sessions_expire_after_the_ttl():
    h = Harness(sessions=Sessions(ttl_s=60))
    h.worker()
    turn(h, "t1", prompt(5))
    h.clock.now += 61
    h.core.expire()
    assert not h.core.sessions.parked


def test_a_timed_out_turn_is_not_parked():
    h = Harness()
    h.worker()
    h.submit("t1", prompt(5), 50, session=wire.SessionRef(key="s1"), timeout_s=1)
    h.cycle()
    h.clock.now += 2
    h.core.expire()
    assert h.final("t1").finish_reason == "timeout" and not h.core.sessions.parked


def test_a_parked_sequence_is_taken_over_only_by_a_turn_of_its_cache_domain():
    h = Harness()
    h.worker()
    history = turn(h, "t1", prompt(5))
    h.submit("t2", history + [WOR], 2, session=wire.SessionRef(key="s1"), cache_domain="salted")
    (seq,) = seqs_of(h.build(), "t2")
    assert seq.seq_id != h.core.sessions.parked["s1"].seq_id and seq.backtrack == 0  # a sequence of its own
    assert seq.cache_domain == "salted" and h.core.requests["t2"].cached_tokens == 0
