"""Salience sessions in the session store's SQLite layer: offsets, truncation, images, fork, lease, TTL."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from common import wire
from services.session_store.salience import SalienceSessions, SessionError


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sessions(tmp_path: Path, clock: Clock) -> SalienceSessions:
    return SalienceSessions(connect(tmp_path / "s.sqlite3"), ttl_s=60, clock=clock)


def begin(sessions: SalienceSessions, session_id: str, offset: int, append: list[int] = (), **fields) -> wire.SalienceSession:
    fields.setdefault("max_len", 100)
    fields.setdefault("lease_s", 30)
    return sessions.begin(wire.SalienceBegin(session_id=session_id, offset=offset, append_tokens=list(append), **fields))


def image(start: int, end: int) -> wire.ImageInput:
    return wire.ImageInput(start=start, end=end, data=b"img%d" % start, mime="image/png")


def code_of(call) -> str:
    with pytest.raises(SessionError) as info:
        call()
    return info.value.code


def test_turns_append_and_offsets_are_checked(sessions) -> None:
    sid = sessions.open("m").session_id
    turn = begin(sessions, sid, 0, [1, 2, 3])
    assert turn.tokens == [1, 2, 3] and turn.lease
    sessions.end(wire.SalienceEnd(session_id=sid, lease=turn.lease, append_tokens=[4, 5]))
    assert sessions.get(sid).tokens == [1, 2, 3, 4, 5]
    assert code_of(lambda: begin(sessions, sid, 4)) == "failed_precondition"  # drift
    assert code_of(lambda: begin(sessions, sid, 6, truncating=True)) == "failed_precondition"  # past the end
    rewind = begin(sessions, sid, 2, [9], truncating=True)
    assert rewind.tokens == [1, 2, 9]
    sessions.end(wire.SalienceEnd(session_id=sid, lease=rewind.lease))
    assert code_of(lambda: begin(sessions, sid, 3, [7] * 90, reserve_tokens=8)) == "resource_exhausted"
    assert sessions.get(sid).tokens == [1, 2, 9]


def test_check_only_makes_the_checks_and_changes_nothing(sessions) -> None:
    sid = sessions.open("m").session_id
    turn = begin(sessions, sid, 0, [1, 2, 3])
    assert code_of(lambda: begin(sessions, sid, 3, check_only=True)) == "aborted"  # busy
    sessions.end(wire.SalienceEnd(session_id=sid, lease=turn.lease))
    assert code_of(lambda: begin(sessions, sid, 0, check_only=True)) == "failed_precondition"
    assert code_of(lambda: begin(sessions, sid, 3, [5] * 98, check_only=True)) == "resource_exhausted"
    assert begin(sessions, sid, 1, [7], truncating=True, check_only=True).lease == ""
    assert sessions.get(sid).tokens == [1, 2, 3]
    begin(sessions, sid, 3)  # no lease was left behind


def test_one_turn_at_a_time_and_an_expired_lease_is_let_go(sessions, clock) -> None:
    sid = sessions.open("m").session_id
    first = begin(sessions, sid, 0, [1])
    assert code_of(lambda: begin(sessions, sid, 1)) == "aborted"
    clock.now += 31  # the first turn's gateway vanished: its lease runs out
    second = begin(sessions, sid, 1, [2])
    assert code_of(lambda: sessions.end(wire.SalienceEnd(session_id=sid, lease=first.lease, append_tokens=[99]))) == "aborted"
    sessions.end(wire.SalienceEnd(session_id=sid, lease=second.lease, append_tokens=[3]))
    assert sessions.get(sid).tokens == [1, 2, 3]


def test_a_renewed_lease_holds_and_a_lapsed_one_frees_the_session(sessions, clock) -> None:
    sid = sessions.open("m").session_id
    other = sessions.open("m").session_id
    first = begin(sessions, sid, 0, [1], lease_s=5)
    for _ in range(4):  # the turn's gateway lives: its heartbeats keep the lease
        clock.now += 3
        sessions.renew([sid, other], lease_s=5)  # a session without a turn takes no lease from it
        assert code_of(lambda: begin(sessions, sid, 1)) == "aborted"
    begin(sessions, other, 0, [7], lease_s=5)
    clock.now += 6  # its gateway died: no heartbeat renews it, the session is free, the prompt committed
    second = begin(sessions, sid, 1, [2], lease_s=5)
    assert code_of(lambda: sessions.end(wire.SalienceEnd(session_id=sid, lease=first.lease, append_tokens=[99]))) == "aborted"
    sessions.end(wire.SalienceEnd(session_id=sid, lease=second.lease, append_tokens=[3]))
    assert sessions.get(sid).tokens == [1, 2, 3]


def test_images_fork_and_truncation_respect_blocks(sessions) -> None:
    sid = sessions.open("m").session_id
    turn = begin(sessions, sid, 0, list(range(20)), images=[image(2, 6), image(10, 15)])
    sessions.end(wire.SalienceEnd(session_id=sid, lease=turn.lease))
    assert code_of(lambda: sessions.fork(sid, 12)) == "failed_precondition"  # inside [10, 15)
    assert code_of(lambda: sessions.fork(sid, 21)) == "failed_precondition"
    child = sessions.fork(sid, 10)
    assert child.tokens == list(range(10)) and [im.start for im in child.images] == [2] and child.parent == sid
    assert sessions.get(child.session_id).images[0].data == b"img2"
    assert code_of(lambda: begin(sessions, sid, 4, truncating=True)) == "failed_precondition"  # cuts [2, 6)
    rewind = begin(sessions, sid, 8, [1], truncating=True)
    assert [im.start for im in rewind.images] == [2]  # the block past the cut is dropped


def test_ttl_any_call_refreshes_and_close_is_idempotent(sessions, clock) -> None:
    idle, kept = sessions.open("m").session_id, sessions.open("m").session_id
    for _ in range(3):
        clock.now += 40
        sessions.get(kept)
    assert code_of(lambda: sessions.get(idle)) == "not_found"
    assert sessions.expire() == 1  # the idle one, swept
    clock.now += 61
    assert sessions.expire() == 1
    assert code_of(lambda: sessions.get(kept)) == "not_found"
    sessions.close(kept)
    sessions.close("never-opened")


def test_sessions_are_durable(tmp_path: Path, clock) -> None:
    path = tmp_path / "durable.sqlite3"
    first = SalienceSessions(connect(path), ttl_s=60, clock=clock)
    sid = first.open("m").session_id
    turn = begin(first, sid, 0, [5, 6], images=[image(0, 2)])
    first.end(wire.SalienceEnd(session_id=sid, lease=turn.lease, append_tokens=[7]))
    first.conn.close()
    again = SalienceSessions(connect(path), ttl_s=60, clock=clock)
    restored = again.get(sid)
    assert restored.tokens == [5, 6, 7] and restored.images == [image(0, 2)]
