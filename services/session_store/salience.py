"""Salience sessions (salience.proto) in SQLite: token lists, images, idle TTL and the one-turn-at-a-time lease.

A session row holds its tokens (a uint32 array blob), the session it was forked from, when it was
last used, and the lease of the Generate running on it (if any). Images live in their own table,
keyed by the position of their vision block. Every call on a session refreshes its TTL; a session
idle longer than the TTL is gone (deleted on access and by :meth:`SalienceSessions.expire`), but a
session under a live lease never expires: its turn ends with :meth:`end`, which refreshes it.

A session belongs to the user who opened (or forked) it, stored with it so that it survives restarts. To a
caller who is neither its owner nor an admin it does not exist: every call answers as for an unknown id
(:func:`common.tenancy.may_access`), and closing it is the same no-op as closing an unknown one.

Quotas (``tenants.max_sessions_per_user``, ``max_session_tokens_per_user``; :mod:`common.quotas`): opening or
forking past the user's live sessions, and a fork or turn taking their live sessions' tokens (a turn's
``reserve_tokens`` included) past theirs, are refused.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from array import array
from collections.abc import Callable

from common import quotas, wire
from common.config import Tenants
from common.tenancy import may_access
from services.session_store.db import add_owner_column, transaction

SCHEMA = """
CREATE TABLE IF NOT EXISTS salience_sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    model TEXT NOT NULL,
    parent TEXT NOT NULL,
    tokens BLOB NOT NULL,
    last_used REAL NOT NULL,
    lease TEXT NOT NULL DEFAULT '',
    lease_until REAL NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS salience_images (
    session_id TEXT NOT NULL REFERENCES salience_sessions(session_id) ON DELETE CASCADE,
    start INTEGER NOT NULL,
    "end" INTEGER NOT NULL,
    mime TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (session_id, start)
) WITHOUT ROWID;
"""
OWNER_INDEX = "CREATE INDEX IF NOT EXISTS salience_sessions_owner ON salience_sessions(owner)"

NOT_FOUND = "not_found"
FAILED_PRECONDITION = "failed_precondition"
RESOURCE_EXHAUSTED = "resource_exhausted"
ABORTED = "aborted"


class SessionError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _pack(tokens: list[int]) -> bytes:
    return array("I", tokens).tobytes()


def _unpack(blob: bytes) -> list[int]:
    tokens = array("I")
    tokens.frombytes(blob)
    return tokens.tolist()


def split_image(images: list[wire.ImageInput], position: int) -> wire.ImageInput | None:
    """The image whose vision block a cut at ``position`` would split, if any."""
    return next((im for im in images if im.start < position < im.end), None)


class SalienceSessions:
    def __init__(self, conn: sqlite3.Connection, ttl_s: float, implicit_user: str, limits: Tenants | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.conn = conn
        self.ttl_s = ttl_s
        self.limits = limits or Tenants()
        self.clock = clock
        conn.executescript(SCHEMA)
        add_owner_column(conn, "salience_sessions", implicit_user)
        conn.execute(OWNER_INDEX)

    # -- helpers -------------------------------------------------------------------------------

    def _row(self, session_id: str, who: wire.Principal | None) -> sqlite3.Row:
        """A live session's row, its TTL refreshed; expired sessions are deleted here. ``who`` (None: the
        turn's own lease holder, checked by lease) must be its owner or an admin, else it is not found."""
        now = self.clock()
        row = self.conn.execute("SELECT * FROM salience_sessions WHERE session_id=?", (session_id,)).fetchone()
        if row is not None and row["last_used"] + self.ttl_s < now and row["lease_until"] < now:
            self._delete(session_id)
            row = None
        if row is None or (who is not None and not may_access(row["owner"], who)):
            raise SessionError(NOT_FOUND, f"no session {session_id!r} (never opened, closed, or expired after "
                                          f"{self.ttl_s:g} s idle)")
        self.conn.execute("UPDATE salience_sessions SET last_used=? WHERE session_id=?", (now, session_id))
        return row

    def _held(self, owner: str, besides: str = "") -> tuple[int, int]:
        """The live sessions ``owner`` holds and their tokens (but session ``besides``'s)."""
        now = self.clock()
        count, size = self.conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(tokens)), 0) FROM salience_sessions WHERE owner=? AND session_id!=?"
            " AND (last_used >= ? OR lease_until >= ?)", (owner, besides, now - self.ttl_s, now)).fetchone()
        return count, size // 4  # uint32 tokens

    def _check_quotas(self, owner: str, sessions: int, tokens: int, besides: str = "") -> None:
        """Whether ``owner`` may hold ``sessions`` more sessions and ``tokens`` more tokens (than their sessions
        but ``besides`` hold); QuotaExceeded if not."""
        held_sessions, held_tokens = self._held(owner, besides)
        quotas.check("max_sessions_per_user", self.limits.max_sessions_per_user, owner, held_sessions, sessions,
                     "live Salience sessions")
        quotas.check("max_session_tokens_per_user", self.limits.max_session_tokens_per_user, owner, held_tokens,
                     tokens, "tokens in their live Salience sessions")

    def _images(self, session_id: str) -> list[wire.ImageInput]:
        rows = self.conn.execute(
            'SELECT start, "end", mime, data FROM salience_images WHERE session_id=? ORDER BY start', (session_id,)
        )
        return [wire.ImageInput(start=r["start"], end=r["end"], mime=r["mime"], data=bytes(r["data"])) for r in rows]

    def _put_images(self, session_id: str, images: list[wire.ImageInput]) -> None:
        self.conn.executemany(
            'INSERT OR REPLACE INTO salience_images (session_id, start, "end", mime, data) VALUES (?,?,?,?,?)',
            [(session_id, im.start, im.end, im.mime, im.data) for im in images],
        )

    def _delete(self, session_id: str) -> None:
        self.conn.execute("DELETE FROM salience_images WHERE session_id=?", (session_id,))
        self.conn.execute("DELETE FROM salience_sessions WHERE session_id=?", (session_id,))

    def _create(self, owner: str, model: str, parent: str, tokens: list[int], images: list[wire.ImageInput]) -> str:
        session_id = f"sess-{uuid.uuid4().hex}"
        self.conn.execute(
            "INSERT INTO salience_sessions (session_id, owner, model, parent, tokens, last_used) VALUES (?,?,?,?,?,?)",
            (session_id, owner, model, parent, _pack(tokens), self.clock()),
        )
        self._put_images(session_id, images)
        return session_id

    # -- operations ----------------------------------------------------------------------------

    def open(self, model: str, who: wire.Principal) -> wire.SalienceSession:
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            self._check_quotas(who.user, 1, 0)
            return wire.SalienceSession(session_id=self._create(who.user, model, "", [], []))

    def close(self, session_id: str, who: wire.Principal) -> bool:
        """Idempotent (salience.proto): an unknown session, or another user's, is left as it is; whether one closed."""
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            row = self.conn.execute("SELECT owner FROM salience_sessions WHERE session_id=?", (session_id,)).fetchone()
            if row is None or not may_access(row["owner"], who):
                return False
            self._delete(session_id)
            return True

    def get(self, session_id: str, who: wire.Principal) -> wire.SalienceSession:
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            row = self._row(session_id, who)
            return wire.SalienceSession(
                session_id=session_id,
                tokens=_unpack(row["tokens"]),
                images=self._images(session_id),
                parent=row["parent"],
            )

    def fork(self, session_id: str, at: int, who: wire.Principal) -> wire.SalienceSession:
        """The fork belongs to ``who`` (an admin forking another user's session owns the fork)."""
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            row = self._row(session_id, who)
            tokens = _unpack(row["tokens"])
            if at > len(tokens):
                raise SessionError(FAILED_PRECONDITION, f"at_position {at} is past the session's {len(tokens)} tokens")
            images = self._images(session_id)
            cut = split_image(images, at)
            if cut is not None:
                raise SessionError(
                    FAILED_PRECONDITION,
                    f"at_position {at} falls inside the image block [{cut.start}, {cut.end}); fork at a block boundary",
                )
            kept = [im for im in images if im.end <= at]
            self._check_quotas(who.user, 1, at)
            child = self._create(who.user, row["model"], session_id, tokens[:at], kept)
            return wire.SalienceSession(session_id=child, tokens=tokens[:at], images=kept, parent=session_id)

    def begin(self, msg: wire.SalienceBegin) -> wire.SalienceSession:
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            row = self._row(msg.session_id, msg.caller)
            now = self.clock()
            if row["lease"] and row["lease_until"] >= now:
                raise SessionError(ABORTED, f"session busy: session {msg.session_id!r} has a Generate running")
            tokens = _unpack(row["tokens"])
            images = self._images(msg.session_id)
            length = len(tokens)
            if msg.offset != length and not (msg.truncating and msg.offset < length):
                why = "" if msg.offset < length else "; it cannot be past the session's end"
                raise SessionError(
                    FAILED_PRECONDITION,
                    f"offset {msg.offset} does not match the session's {length} tokens "
                    f"(truncating={str(msg.truncating).lower()}{why})",
                )
            if msg.offset < length:
                cut = split_image(images, msg.offset)
                if cut is not None:
                    raise SessionError(
                        FAILED_PRECONDITION,
                        f"truncating to {msg.offset} would split the image block [{cut.start}, {cut.end})",
                    )
            new_length = msg.offset + len(msg.append_tokens)
            if new_length + msg.reserve_tokens > msg.max_len:
                raise SessionError(
                    RESOURCE_EXHAUSTED,
                    f"the session would hold {new_length} tokens plus {msg.reserve_tokens} to generate, over the "
                    f"model's context of {msg.max_len}",
                )
            self._check_quotas(row["owner"], 0, new_length + msg.reserve_tokens, besides=msg.session_id)
            if msg.check_only:
                return wire.SalienceSession(session_id=msg.session_id)
            tokens = tokens[: msg.offset] + list(msg.append_tokens)
            dropped = [im.start for im in images if im.end > msg.offset]
            self.conn.executemany(
                "DELETE FROM salience_images WHERE session_id=? AND start=?", [(msg.session_id, s) for s in dropped]
            )
            self._put_images(msg.session_id, msg.images)
            lease = uuid.uuid4().hex
            self.conn.execute(
                "UPDATE salience_sessions SET tokens=?, lease=?, lease_until=? WHERE session_id=?",
                (_pack(tokens), lease, now + msg.lease_s, msg.session_id),
            )
            return wire.SalienceSession(
                session_id=msg.session_id,
                tokens=tokens,
                images=self._images(msg.session_id),
                parent=row["parent"],
                lease=lease,
            )

    def end(self, msg: wire.SalienceEnd) -> None:
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            row = self._row(msg.session_id, None)
            if row["lease"] != msg.lease:
                raise SessionError(ABORTED, f"the turn's lease on session {msg.session_id!r} had expired")
            tokens = _unpack(row["tokens"]) + list(msg.append_tokens)
            self.conn.execute(
                "UPDATE salience_sessions SET tokens=?, lease='', lease_until=0 WHERE session_id=?",
                (_pack(tokens), msg.session_id),
            )

    def renew(self, session_ids: list[str], lease_s: float) -> None:
        """Extend the busy leases of these sessions' running turns (their gateway's heartbeat)."""
        until = self.clock() + lease_s
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            self.conn.executemany(
                "UPDATE salience_sessions SET lease_until=? WHERE session_id=? AND lease != ''",
                [(until, session_id) for session_id in session_ids],
            )

    def expire(self) -> int:
        """Delete every session idle past the TTL (and not under a live lease); returns how many."""
        now = self.clock()
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            ids = [
                r[0]
                for r in self.conn.execute(
                    "SELECT session_id FROM salience_sessions WHERE last_used < ? AND lease_until < ?",
                    (now - self.ttl_s, now),
                )
            ]
            for session_id in ids:
                self._delete(session_id)
        return len(ids)
