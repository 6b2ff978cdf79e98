"""SQLite (WAL) storage of request records and feedback; one connection, owned by the service loop."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    rid TEXT PRIMARY KEY,
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
"""


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.executescript(SCHEMA)

    def record_request(self, rid: str, surface: str, model: str, prompt: str, params: dict[str, Any],
                       created_at: float) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO requests (rid, surface, model, prompt, params, created_at) VALUES (?,?,?,?,?,?)",
            (rid, surface, model, prompt, json.dumps(params), created_at or time.time()),
        )

    def record_completion(self, rid: str, generated_text: str, finish_reason: str, prompt_tokens: int,
                          completion_tokens: int, error: str) -> bool:
        cursor = self.conn.execute(
            "UPDATE requests SET generated_text=?, finish_reason=?, prompt_tokens=?, completion_tokens=?, error=?,"
            " finished_at=? WHERE rid=?",
            (generated_text, finish_reason, prompt_tokens, completion_tokens, error, time.time(), rid),
        )
        return cursor.rowcount == 1

    def record_feedback(self, rid: str, rating: float, text: str, position: int | None) -> int | None:
        """Store feedback for a known request; None when the request is unknown."""
        if self.conn.execute("SELECT 1 FROM requests WHERE rid=?", (rid,)).fetchone() is None:
            return None
        cursor = self.conn.execute(
            "INSERT INTO feedback (rid, rating, text, position, created_at) VALUES (?,?,?,?,?)",
            (rid, rating, text, position, time.time()),
        )
        return int(cursor.lastrowid)

    def get_request(self, rid: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT * FROM requests WHERE rid=?", (rid,)).fetchone()
        if row is None:
            return None
        record = dict(row)
        record["params"] = json.loads(record["params"])
        record["feedback"] = [
            dict(f) for f in self.conn.execute(
                "SELECT id, rating, text, position, created_at FROM feedback WHERE rid=? ORDER BY id", (rid,)
            )
        ]
        return record

    def close(self) -> None:
        self.conn.close()
