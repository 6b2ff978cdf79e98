"""Placement of new sequences: session, then longest cached prefix, then least loaded."""

from __future__ import annotations

from common.blocks import prefix_keys
from services.scheduler.placement import Candidate, Decision, PrefixIndex, choose

A, B, C = b"a", b"b", b"c"
PROMPT = list(range(100, 180))  # five full blocks
KEYS = list(prefix_keys(PROMPT))


def workers(free_a: int = 1000, free_b: int = 1000, free_c: int = 1000, running: tuple[int, int, int] = (0, 0, 0)):
    return [Candidate(A, free_a, running[0]), Candidate(B, free_b, running[1]), Candidate(C, free_c, running[2])]


def test_the_index_follows_block_events() -> None:
    index = PrefixIndex()
    index.apply(A, KEYS[:3], [])
    index.apply(B, KEYS, [])
    assert index.matches(KEYS, [A, B, C]) == {A: 3, B: 5, C: 0}
    index.apply(B, [], KEYS[1:2])  # a hole: only the leading run counts
    assert index.matches(KEYS, [A, B, C]) == {A: 3, B: 1, C: 0}
    index.forget(A)
    assert index.matches(KEYS, [A, B]) == {A: 0, B: 1} and index.blocks(A) == 0 and index.blocks(B) == 4
    index.forget(B)
    assert index.matches(KEYS, [A, B]) == {A: 0, B: 0} and index.blocks(B) == 0


def test_least_loaded_without_any_cached_prefix() -> None:
    assert choose(workers(free_b=2000), 100, KEYS, PrefixIndex()) == Decision(B, "load")
    # fewer running sequences first, then more room
    assert choose(workers(free_b=2000, running=(1, 3, 2)), 100, KEYS, PrefixIndex()) == Decision(A, "load")


def test_longest_prefix_wins_over_load() -> None:
    index = PrefixIndex()
    index.apply(A, KEYS[:2], [])
    index.apply(C, KEYS[:4], [])
    assert choose(workers(free_b=5000), 100, KEYS, index) == Decision(C, "prefix", 4)
    # another prompt sharing only the first block: the tie goes to the freer of A and C
    other = list(prefix_keys(PROMPT[:16] + list(range(900, 964))))
    assert choose(workers(free_a=2000), 100, other, index) == Decision(A, "prefix", 1)


def test_a_prefix_holder_without_room_or_far_busier_is_passed_over() -> None:
    index = PrefixIndex()
    index.apply(C, KEYS, [])
    assert choose(workers(free_c=50), 100, KEYS, index) == Decision(A, "load")
    assert choose(workers(running=(0, 0, 9)), 100, KEYS, index, balance=8) == Decision(A, "load")
    assert choose(workers(running=(0, 0, 8)), 100, KEYS, index, balance=8) == Decision(C, "prefix", 5)


def test_session_worker_first_when_it_has_room() -> None:
    index = PrefixIndex()
    index.apply(C, KEYS, [])
    assert choose(workers(), 100, KEYS, index, session_worker=B) == Decision(B, "session")
    assert choose(workers(free_b=10), 100, KEYS, index, session_worker=B) == Decision(C, "prefix", 5)
    assert choose(workers(free_a=10, free_b=10, free_c=10), 100, KEYS, index, session_worker=B) is None


def test_session_worker_that_left_is_not_chosen() -> None:
    assert choose(workers()[:2], 100, KEYS, PrefixIndex(), session_worker=C).reason == "load"
