"""Placement of new sequences: session, then longest cached prefix, then the rendezvous hash of the
first block (a prompt shorter than a block: least loaded)."""

from __future__ import annotations

from common.blocks import ROOT_HASH, block_hash, block_key, prefix_keys
from services.scheduler.placement import Candidate, Decision, PrefixIndex, choose, rendezvous

A, B, C = b"a", b"b", b"c"
PROMPT = list(range(100, 180))  # five full blocks
KEYS = list(prefix_keys(PROMPT))


def workers(free_a: int = 1000, free_b: int = 1000, free_c: int = 1000, running: tuple[int, int, int] = (0, 0, 0)):
    return [Candidate(A, free_a, running[0]), Candidate(B, free_b, running[1]), Candidate(C, free_c, running[2])]


def test_prefix_keys_are_the_workers_block_names() -> None:
    """The keys placement computes are those of the hash chain a worker's cache names its blocks by
    (``block_hash`` of each full block on its parent's name); a partial last block has none."""
    tokens = [(i * 7919) % 50000 for i in range(16 * 5 + 9)]
    names, parent = [], ROOT_HASH
    for j in range(5):
        parent = block_hash(parent, tokens[j * 16 : (j + 1) * 16])
        names.append(block_key(parent))
    assert list(prefix_keys(tokens)) == names
    assert list(prefix_keys(tokens, limit=2)) == names[:2] and list(prefix_keys(tokens[:15])) == []
    assert list(prefix_keys(tokens, block_size=4))[0] == block_key(block_hash(ROOT_HASH, tokens[:4]))


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


def test_a_worker_joining_after_one_left_starts_with_nothing_cached() -> None:
    """Workers that come and go (the index names holders by small numbers it reuses): a newcomer holds
    none of the blocks of the worker that left, and the others keep theirs."""
    index = PrefixIndex()
    index.apply(A, KEYS, [])
    index.apply(B, KEYS[:2], [])
    index.forget(A)
    index.apply(C, [], [])  # C joins: nothing cached yet
    assert index.matches(KEYS, [A, B, C]) == {A: 0, B: 2, C: 0}
    index.apply(C, KEYS[:4], [])
    index.apply(A, KEYS[:1], [])  # A back, reporting afresh
    assert index.matches(KEYS, [A, B, C]) == {A: 1, B: 2, C: 4}
    index.forget(B)
    assert index.matches(KEYS, [A, B, C]) == {A: 1, B: 0, C: 4}


def ranked(keys: list[int], among: list[bytes]) -> list[bytes]:
    """``among`` by how highly the first of ``keys`` ranks them."""
    return sorted(among, key=lambda w: rendezvous(w, keys[0]), reverse=True)


def test_an_uncached_prompt_goes_where_its_first_block_hashes() -> None:
    first = ranked(KEYS, [A, B, C])[0]
    assert choose(workers(), 100, KEYS, PrefixIndex()) == Decision(first, "hash")
    # a prompt sharing only the first block hashes the same way: a new prefix's requests gather
    other = list(prefix_keys(PROMPT[:16] + list(range(900, 964))))
    assert choose(workers(), 100, other, PrefixIndex()) == Decision(first, "hash")
    # prompts with other first blocks spread over the workers
    firsts = {choose(workers(), 100, list(prefix_keys(list(range(s, s + 16)))), PrefixIndex()).identity
              for s in range(1000, 1400, 16)}
    assert firsts == {A, B, C}


def test_the_hash_yields_to_load_and_the_overflow_goes_to_the_next_ranked() -> None:
    first, second, third = ranked(KEYS, [A, B, C])
    running = {first: 9, second: 0, third: 0}
    busy = workers(running=(running[A], running[B], running[C]))
    assert choose(busy, 100, KEYS, PrefixIndex(), balance=8) == Decision(second, "hash")
    assert choose(busy, 100, KEYS, PrefixIndex(), balance=9) == Decision(first, "hash")


def test_least_loaded_for_a_prompt_shorter_than_a_block() -> None:
    assert choose(workers(free_b=2000), 10, [], PrefixIndex()) == Decision(B, "load")
    # fewer running sequences first, then more room
    assert choose(workers(free_b=2000, running=(1, 3, 2)), 10, [], PrefixIndex()) == Decision(A, "load")


def test_longest_prefix_wins_over_load_and_hash() -> None:
    index = PrefixIndex()
    index.apply(A, KEYS[:2], [])
    index.apply(C, KEYS[:4], [])
    assert choose(workers(free_b=5000, running=(0, 0, 8)), 100, KEYS, index) == Decision(C, "prefix", 4)
    # another prompt sharing only the first block: the tie between A and C goes the hash's way
    other = list(prefix_keys(PROMPT[:16] + list(range(900, 964))))
    assert choose(workers(free_a=2000), 100, other, index) == Decision(ranked(other, [A, C])[0], "prefix", 1)


def test_a_prefix_holder_without_room_or_far_busier_is_passed_over() -> None:
    index = PrefixIndex()
    index.apply(C, KEYS, [])
    assert choose(workers(free_c=50), 100, KEYS, index).identity != C
    assert choose(workers(running=(0, 0, 9)), 100, KEYS, index, balance=8).identity != C
    assert choose(workers(running=(0, 0, 8)), 100, KEYS, index, balance=8) == Decision(C, "prefix", 5)


def test_session_worker_first_when_it_has_room() -> None:
    index = PrefixIndex()
    index.apply(C, KEYS, [])
    assert choose(workers(), 100, KEYS, index, session_worker=B) == Decision(B, "session")
    assert choose(workers(free_b=10), 100, KEYS, index, session_worker=B) == Decision(C, "prefix", 5)
    assert choose(workers(free_a=10, free_b=10, free_c=10), 100, KEYS, index, session_worker=B) is None


def test_session_worker_that_left_is_not_chosen() -> None:
    assert choose(workers()[:2], 100, KEYS, PrefixIndex(), session_worker=C).identity != C


def test_a_promised_prefix_counts_until_reported_or_pushed_out() -> None:
    index = PrefixIndex()
    index.promise(A, KEYS[:3], limit=100)  # placed on A, its prefill not run yet
    assert index.matches(KEYS, [A, B]) == {A: 3, B: 0} and index.blocks(A) == 0
    index.apply(A, KEYS[:2], [])  # reported: no longer a promise, and forgotten as usual
    index.apply(A, [], KEYS[:1])
    assert index.matches(KEYS, [A]) == {A: 0}
    index.apply(A, [], KEYS[2:3])  # a promise is not undone by a gone event for a block never reported
    assert index.matches(KEYS[1:], [A]) == {A: 2}
    index.promise(B, KEYS, limit=3)  # B holds 3 blocks at most: the oldest promises go
    assert index.matches(KEYS, [B]) == {B: 0} and index.matches(KEYS[2:], [B]) == {B: 3}
    index.forget(B)
    assert index.matches(KEYS[2:], [A, B]) == {A: 1, B: 0}


def test_a_burst_sharing_a_new_prefix_follows_the_first_placed() -> None:
    """Requests placed before any block event is back: the second goes where the first was sent,
    even when the hash of its first block ranks another worker first."""
    index = PrefixIndex()
    first = ranked(KEYS, [A, B, C])[0]
    index.promise(first, KEYS, limit=100)
    # a prompt with another first block that shares nothing: its own hash
    other = list(prefix_keys(list(range(500, 580))))
    assert choose(workers(), 100, other, index).reason == "hash"
    assert choose(workers(), 100, KEYS, index) == Decision(first, "prefix", 5)
