"""SQLite (WAL) storage of request records and feedback; one connection, owned by the service loop.

Every request record has an owner (the user who made the request); a lookup or feedback by anyone else
but an admin finds nothing (:func:`common.tenancy.may_access`). A database made before owners existed
gets the column on open, its rows owned by the implicit user (:func:`add_owner_column`)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import wire
from common.tenancy import may_access

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    rid TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    surface TEXT NOT NULL,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    params TEXT NOT NULL,
    created_at REAL NOT NULL,
    generated_text TEXT,
    finish_reason TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    error TEXT,
    finished_at REAL
);
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rid TEXT NOT NULL REFERENCES requests(rid),
    rating REAL NOT NULL,
    text TEXT NOT NULL,
    position INTEGER,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_rid ON feedback(rid);
CREATE TABLE IF NOT EXISTS responses (
    response_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    conversation TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses(expires_at);
CREATE TABLE IF NOT EXISTS evergreen_fragments (
    session_id TEXT NOT NULL,
    node_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    fragment BLOB NOT NULL,
    PRIMARY KEY (session_id, node_id, seq)
) WITHOUT ROWID;
"""


@contextmanager
def transaction(conn: sqlite3.Connection, begin: str = "BEGIN") -> Iterator[None]:
    """One transaction on an autocommit-mode connection: committed when the block ends, rolled
    back when it raises. ``begin="BEGIN IMMEDIATE"`` takes the write lock at once."""
    conn.execute(begin)
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def add_owner_column(conn: sqlite3.Connection, table: str, implicit_user: str) -> None:
    """The migration of a table made before owners existed: an ``owner`` column, its rows owned by
    ``implicit_user`` (who made them all: there were no users apart). Nothing when it has the column."""
    if any(row[1] == "owner" for row in conn.execute(f"PRAGMA table_info({table})")):
        return
    with transaction(conn, "BEGIN IMMEDIATE"):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        conn.execute(f"UPDATE {table} SET owner=?", (implicit_user,))


class BadRecord(ValueError):
    """A record the store cannot keep as it came (the message decoded, but a value does not fit its column)."""


class Store:
    def __init__(self, path: Path, implicit_user: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.executescript(SCHEMA)
        add_owner_column(self.conn, "requests", implicit_user)

    def record_request(self, rid: str, owner: str, surface: str, model: str, prompt: str, params: dict[str, Any],
                       created_at: float) -> None:
        """BadRecord: ``params`` is not JSON (msgpack carries bytes and nesting JSON has no room for)."""
        try:
            params_json = json.dumps(params)
        except (TypeError, ValueError, RecursionError) as exc:
            raise BadRecord(f"the request's params are not JSON: {exc}") from exc
        self.conn.execute(
            "INSERT OR REPLACE INTO requests (rid, owner, surface, model, prompt, params, created_at)"
            " VALUES (?,?,?,?,?,?,?)",
            (rid, owner, surface, model, prompt, params_json, created_at or time.time()),
        )

    def record_completion(self, rid: str, generated_text: str, finish_reason: str, prompt_tokens: int,
                          completion_tokens: int, error: str) -> bool:
        cursor = self.conn.execute(
            "UPDATE requests SET generated_text=?, finish_reason=?, prompt_tokens=?, completion_tokens=?, error=?,"
            " finished_at=? WHERE rid=?",
            (generated_text, finish_reason, prompt_tokens, completion_tokens, error, time.time(), rid),
        )
        return cursor.rowcount == 1

    def _owner(self, rid: str) -> str | None:
        row = self.conn.execute("SELECT owner FROM requests WHERE rid=?", (rid,)).fetchone()
        return None if row is None else row[0]

    def record_feedback(self, rid: str, who: wire.Principal, rating: float, text: str,
                        position: int | None) -> int | None:
        """Store feedback for a request ``who`` may reach; None when there is none (unknown, or another user's)."""
        owner = self._owner(rid)
        if owner is None or not may_access(owner, who):
            return None
        cursor = self.conn.execute(
            "INSERT INTO feedback (rid, rating, text, position, created_at) VALUES (?,?,?,?,?)",
            (rid, rating, text, position, time.time()),
        )
        return int(cursor.lastrowid)

    def get_request(self, rid: str, who: wire.Principal) -> wire.RequestRecord | None:
        """The record of a request ``who`` may reach; None when there is none (unknown, or another user's)."""
        row = self.conn.execute("SELECT * FROM requests WHERE rid=?", (rid,)).fetchone()
        if row is None or not may_access(row["owner"], who):
            return None
        feedback = self.conn.execute(
            "SELECT id, rating, text, position, created_at FROM feedback WHERE rid=? ORDER BY id", (rid,)
        )
        return wire.RequestRecord(
            **{**{k: row[k] for k in row.keys() if k != "owner"}, "params": json.loads(row["params"])},
            feedback=[wire.FeedbackEntry(**dict(f)) for f in feedback],
        )

    # -- stored responses (the OpenAI Responses API) ---------------------------------------

    def response_put(self, msg: wire.ResponsePut) -> None:
        now = time.time()
        self.conn.execute(
            "INSERT OR REPLACE INTO responses (response_id, owner, body, input_items, conversation, created_at,"
            " expires_at) VALUES (?,?,?,?,?,?,?)",
            (msg.response_id, msg.owner, msg.body, msg.input_items, msg.conversation, now, now + msg.ttl_s),
        )

    def response_get(self, response_id: str) -> wire.ResponseRecord | None:
        """The response unless unknown or past its TTL."""
        row = self.conn.execute(
            "SELECT response_id, owner, body, input_items, conversation, created_at FROM responses"
            " WHERE response_id=? AND expires_at>?", (response_id, time.time())).fetchone()
        return None if row is None else wire.ResponseRecord(**dict(row))

    def response_delete(self, response_id: str) -> bool:
        cursor = self.conn.execute("DELETE FROM responses WHERE response_id=? AND expires_at>?",
                                   (response_id, time.time()))
        return cursor.rowcount == 1

    def expire_responses(self) -> int:
        return self.conn.execute("DELETE FROM responses WHERE expires_at<=?", (time.time(),)).rowcount

    # -- Evergreen node graphs -------------------------------------------------------------

    def evergreen_put(self, session_id: str, fragments: list[tuple[str, int, bytes]]) -> None:
        """Store fragments; the first one stored for a (node, seq) is kept, as the Evergreen spec requires."""
        with transaction(self.conn):
            self.conn.executemany(
                "INSERT OR IGNORE INTO evergreen_fragments (session_id, node_id, seq, fragment) VALUES (?,?,?,?)",
                [(session_id, node_id, seq, fragment) for node_id, seq, fragment in fragments],
            )

    def evergreen_drop(self, session_id: str, node_ids: list[str]) -> None:
        with transaction(self.conn):
            self.conn.executemany(
                "DELETE FROM evergreen_fragments WHERE session_id=? AND node_id=?",
                [(session_id, node_id) for node_id in node_ids],
            )

    def evergreen_close(self, session_id: str) -> None:
        self.conn.execute("DELETE FROM evergreen_fragments WHERE session_id=?", (session_id,))

    def evergreen_session_ids(self) -> list[str]:
        return [r[0] for r in self.conn.execute("SELECT DISTINCT session_id FROM evergreen_fragments")]

    def evergreen_fragments(self, session_id: str) -> list[wire.EvergreenFragment]:
        rows = self.conn.execute(
            "SELECT node_id, seq, fragment FROM evergreen_fragments WHERE session_id=? ORDER BY node_id, seq",
            (session_id,),
        )
        return [wire.EvergreenFragment(node_id=r["node_id"], seq=r["seq"], fragment=bytes(r["fragment"])) for r in rows]

    def close(self) -> None:
        self.conn.close()
