"""Salience sessions in the session store's SQLite layer: offsets, truncation, images, fork, lease, TTL."""

from __future__ import annotations

import sqlite3
from array import array
from pathlib import Path

import pytest

from common import wire
from common.config import Tenants
from common.quotas import QuotaExceeded
from services.session_store.salience import SalienceSessions, SessionError


ME = wire.Principal(user="alice")


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
    return SalienceSessions(connect(tmp_path / "s.sqlite3"), ttl_s=60, implicit_user="localhost", clock=clock)


def begin(sessions: SalienceSessions, session_id: str, offset: int, append: list[int] = (), **fields) -> wire.SalienceSession:
    fields.setdefault("max_len", 100)
    fields.setdefault("lease_s", 30)
    fields.setdefault("caller", ME)
    return sessions.begin(wire.SalienceBegin(session_id=session_id, offset=offset, append_tokens=list(append), **fields))


def image(start: int, end: int) -> wire.ImageInput:
    return wire.ImageInput(start=start, end=end, data=b"img%d" % start, mime="image/png")


def code_of(call) -> str:
    with pytest.raises(SessionError) as info:
        call()
    return info.value.code


def test_turns_append_and_offsets_are_checked(sessions) -> None:
    sid = sessions.open("m", ME).session_id
    turn = begin(sessions, sid, 0, [1, 2, 3])
    assert turn.tokens == [1, 2, 3] and turn.lease
    sessions.end(wire.SalienceEnd(session_id=sid, lease=turn.lease, append_tokens=[4, 5]))
    assert sessions.get(sid, ME).tokens == [1, 2, 3, 4, 5]
    assert code_of(lambda: begin(sessions, sid, 4)) == "failed_precondition"  # drift
    assert code_of(lambda: begin(sessions, sid, 6, truncating=True)) == "failed_precondition"  # past the end
    rewind = begin(sessions, sid, 2, [9], truncating=True)
    assert rewind.tokens == [1, 2, 9]
    sessions.end(wire.SalienceEnd(session_id=sid, lease=rewind.lease))
    assert code_of(lambda: begin(sessions, sid, 3, [7] * 90, reserve_tokens=8)) == "resource_exhausted"
    assert sessions.get(sid, ME).tokens == [1, 2, 9]


def test_check_only_makes_the_checks_and_changes_nothing(sessions) -> None:
    sid = sessions.open("m", ME).session_id
    turn = begin(sessions, sid, 0, [1, 2, 3])
    assert code_of(lambda: begin(sessions, sid, 3, check_only=True)) == "aborted"  # busy
    sessions.end(wire.SalienceEnd(session_id=sid, lease=turn.lease))
    assert code_of(lambda: begin(sessions, sid, 0, check_only=True)) == "failed_precondition"
    assert code_of(lambda: begin(sessions, sid, 3, [5] * 98, check_only=True)) == "resource_exhausted"
    assert begin(sessions, sid, 1, [7], truncating=True, check_only=True).lease == ""
    assert sessions.get(sid, ME).tokens == [1, 2, 3]
    begin(sessions, sid, 3)  # no lease was left behind


def test_one_turn_at_a_time_and_an_expired_lease_is_let_go(sessions, clock) -> None:
    sid = sessions.open("m", ME).session_id
    first = begin(sessions, sid, 0, [1])
    assert code_of(lambda: begin(sessions, sid, 1)) == "aborted"
    clock.now += 31  # the first turn's gateway vanished: its lease runs out
    second = begin(sessions, sid, 1, [2])
    assert code_of(lambda: sessions.end(wire.SalienceEnd(session_id=sid, lease=first.lease, append_tokens=[99]))) == "aborted"
    sessions.end(wire.SalienceEnd(session_id=sid, lease=second.lease, append_tokens=[3]))
    assert sessions.get(sid, ME).tokens == [1, 2, 3]


def test_a_renewed_lease_holds_and_a_lapsed_one_frees_the_session(sessions, clock) -> None:
    sid = sessions.open("m", ME).session_id
    other = sessions.open("m", ME).session_id
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
    assert sessions.get(sid, ME).tokens == [1, 2, 3]


def test_images_fork_and_truncation_respect_blocks(sessions) -> None:
    sid = sessions.open("m", ME).session_id
    turn = begin(sessions, sid, 0, list(range(20)), images=[image(2, 6), image(10, 15)])
    sessions.end(wire.SalienceEnd(session_id=sid, lease=turn.lease))
    assert code_of(lambda: sessions.fork(sid, 12, ME)) == "failed_precondition"  # inside [10, 15)
    assert code_of(lambda: sessions.fork(sid, 21, ME)) == "failed_precondition"
    child = sessions.fork(sid, 10, ME)
    assert child.tokens == list(range(10)) and [im.start for im in child.images] == [2] and child.parent == sid
    assert sessions.get(child.session_id, ME).images[0].data == b"img2"
    assert code_of(lambda: begin(sessions, sid, 4, truncating=True)) == "failed_precondition"  # cuts [2, 6)
    rewind = begin(sessions, sid, 8, [1], truncating=True)
    assert [im.start for im in rewind.images] == [2]  # the block past the cut is dropped


def test_ttl_any_call_refreshes_and_close_is_idempotent(sessions, clock) -> None:
    idle, kept = sessions.open("m", ME).session_id, sessions.open("m", ME).session_id
    for _ in range(3):
        clock.now += 40
        sessions.get(kept, ME)
    assert code_of(lambda: sessions.get(idle, ME)) == "not_found"
    assert sessions.expire() == 1  # the idle one, swept
    clock.now += 61
    assert sessions.expire() == 1
    assert code_of(lambda: sessions.get(kept, ME)) == "not_found"
    assert not sessions.close(kept, ME)  # expired: nothing left to close
    assert not sessions.close("never-opened", ME)


def test_sessions_are_durable(tmp_path: Path, clock) -> None:
    path = tmp_path / "durable.sqlite3"
    first = SalienceSessions(connect(path), ttl_s=60, implicit_user="localhost", clock=clock)
    sid = first.open("m", ME).session_id
    turn = begin(first, sid, 0, [5, 6], images=[image(0, 2)])
    first.end(wire.SalienceEnd(session_id=sid, lease=turn.lease, append_tokens=[7]))
    first.conn.close()
    again = SalienceSessions(connect(path), ttl_s=60, implicit_user="localhost", clock=clock)
    restored = again.get(sid, ME)
    assert restored.tokens == [5, 6, 7] and restored.images == [image(0, 2)]


BOB = wire.Principal(user="bob")
ADMIN = wire.Principal(user="root", admin=True)


def test_another_users_session_does_not_exist_for_them(sessions) -> None:
    sid = sessions.open("m", ME).session_id
    turn = begin(sessions, sid, 0, [1, 2, 3])
    sessions.end(wire.SalienceEnd(session_id=sid, lease=turn.lease))
    unknown = "sess-" + "0" * 32
    for session_id in (sid, unknown):  # bob is told exactly what an unknown id gets
        assert code_of(lambda: sessions.get(session_id, BOB)) == "not_found"
        assert code_of(lambda: sessions.fork(session_id, 1, BOB)) == "not_found"
        assert code_of(lambda: begin(sessions, session_id, 3, [4], caller=BOB)) == "not_found"
        assert code_of(lambda: begin(sessions, session_id, 3, check_only=True, caller=BOB)) == "not_found"
        assert not sessions.close(session_id, BOB)  # idempotent either way, and it closes nothing
    assert sessions.get(sid, ME).tokens == [1, 2, 3]
    fork = sessions.fork(sid, 2, ADMIN)  # an admin reaches every session; the fork is the admin's
    assert sessions.get(sid, ADMIN).tokens == [1, 2, 3]
    assert code_of(lambda: sessions.get(fork.session_id, ME)) == "not_found"
    assert sessions.get(fork.session_id, ADMIN).tokens == [1, 2]
    assert sessions.close(sid, ADMIN)
    assert code_of(lambda: sessions.get(sid, ME)) == "not_found"


def test_a_database_made_before_owners_is_migrated_to_the_implicit_user(tmp_path: Path, clock) -> None:
    path = tmp_path / "old.sqlite3"
    old = connect(path)
    old.executescript("""
        CREATE TABLE salience_sessions (session_id TEXT PRIMARY KEY, model TEXT NOT NULL, parent TEXT NOT NULL,
            tokens BLOB NOT NULL, last_used REAL NOT NULL, lease TEXT NOT NULL DEFAULT '',
            lease_until REAL NOT NULL DEFAULT 0) WITHOUT ROWID;""")
    old.execute("INSERT INTO salience_sessions (session_id, model, parent, tokens, last_used) VALUES (?,?,?,?,?)",
                ("sess-old", "m", "", array("I", [4, 5]).tobytes(), clock.now))
    old.close()
    migrated = SalienceSessions(connect(path), ttl_s=60, implicit_user="localhost", clock=clock)
    assert migrated.get("sess-old", wire.Principal(user="localhost")).tokens == [4, 5]
    assert code_of(lambda: migrated.get("sess-old", ME)) == "not_found"
    assert migrated.open("m", ME).session_id  # new rows take their owner


def test_a_users_live_sessions_and_their_tokens_are_capped(tmp_path: Path, clock) -> None:
    limits = Tenants(max_sessions_per_user=2, max_session_tokens_per_user=9)
    sessions = SalienceSessions(connect(tmp_path / "q.sqlite3"), ttl_s=60, implicit_user="localhost", limits=limits,
                                clock=clock)
    first = sessions.open("m", ME).session_id
    turn = begin(sessions, first, 0, [1] * 6, reserve_tokens=2)  # 8 of 9
    sessions.end(wire.SalienceEnd(session_id=first, lease=turn.lease, append_tokens=[2, 2]))
    with pytest.raises(QuotaExceeded, match="tenants.max_session_tokens_per_user = 9"):
        begin(sessions, first, 8, [3], reserve_tokens=2)  # 11
    turn = begin(sessions, first, 4, [3], truncating=True, reserve_tokens=1)  # a rewrite frees its cut: 6, then 5 held
    sessions.end(wire.SalienceEnd(session_id=first, lease=turn.lease))
    with pytest.raises(QuotaExceeded, match="tenants.max_session_tokens_per_user"):
        sessions.fork(first, 5, ME)  # 5 + 5
    second = sessions.fork(first, 4, ME).session_id  # 5 + 4
    with pytest.raises(QuotaExceeded, match="holds 2 live Salience sessions; 1 more would pass "
                                            "tenants.max_sessions_per_user = 2"):
        sessions.open("m", ME)
    assert sessions.open("m", BOB).session_id  # bob's are his own
    sessions.close(second, ME)
    assert sessions.open("m", ME).session_id
    clock.now += 61  # expired sessions hold nothing
    assert sessions.open("m", ME).session_id and sessions.open("m", ME).session_id
