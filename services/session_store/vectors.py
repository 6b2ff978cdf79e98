"""Steering vectors in SQLite (docs/steering.md, "Vectors"): content-addressed, tagged, owned by their uploaders.

A vector row holds its canonical content (:func:`common.steering.encode`), keyed by its id (the content's SHA-256,
computed here, never taken from the message), with its hidden size, layers and norms for listings. Every user who
uploaded it holds it (``steering_vector_holders``); a tag row points one name at a vector under the rules of
:mod:`common.tags`.

Who reaches a vector: its holders, the users who see a tag pointing at it, and admins; to anyone else it is
unknown, word for word as an id no one stored. Deleting is letting go: a holder's delete drops their holding and
their own tags on it, and the vector (with every tag on it) goes once no one holds it; an admin's delete drops it at
once. Quota ``steering.max_vectors_per_user`` counts a user's holdings (storing one they hold again is free).
"""

from __future__ import annotations

import json
import re
import sqlite3
import time

from common import quotas, tags, wire
from common.config import Steering
from common.errors import INVALID_REQUEST, RATE_LIMITED
from common.steering import SteeringError, decode, vector_id
from services.session_store.db import transaction

SCHEMA = """
CREATE TABLE IF NOT EXISTS steering_vectors (
    vector_id TEXT PRIMARY KEY,
    content BLOB NOT NULL,
    hidden_size INTEGER NOT NULL,
    layers TEXT NOT NULL,
    norms TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS steering_vector_holders (
    vector_id TEXT NOT NULL REFERENCES steering_vectors(vector_id) ON DELETE CASCADE,
    user TEXT NOT NULL,
    uploaded_at REAL NOT NULL,
    PRIMARY KEY (vector_id, user)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS steering_vector_holders_user ON steering_vector_holders(user);
CREATE TABLE IF NOT EXISTS steering_tags (
    tag TEXT PRIMARY KEY,
    vector_id TEXT NOT NULL REFERENCES steering_vectors(vector_id) ON DELETE CASCADE,
    owner TEXT NOT NULL,
    public INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    updated_by TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS steering_tags_vector ON steering_tags(vector_id);
"""
NOT_FOUND = "not_found"
_ID = re.compile(r"[0-9a-f]{64}")

VectorMessage = (wire.VectorPut | wire.VectorGet | wire.VectorList | wire.VectorDelete | wire.VectorTag
                 | wire.VectorTagList | wire.VectorLookup)


class _Unknown(Exception):
    """A vector or tag the caller does not reach (the message names it)."""


class SteeringVectors:
    def __init__(self, conn: sqlite3.Connection, limits: Steering) -> None:
        self.conn = conn
        self.limits = limits
        conn.executescript(SCHEMA)

    def handle(self, msg: VectorMessage) -> wire.Msg:
        """The reply to one vector message; a refusal is an ``Error`` (see the module docstring)."""
        try:
            if isinstance(msg, wire.VectorPut):
                return wire.VectorReply(info=self.put(msg.content, msg.tags, msg.caller))
            if isinstance(msg, wire.VectorGet):
                return wire.VectorReply(info=self.info(self.resolve(msg.ref, msg.caller), msg.caller))
            if isinstance(msg, wire.VectorList):
                return wire.VectorInfos(vectors=[self.info(v, msg.caller) for v in self.reachable(msg.caller)])
            if isinstance(msg, wire.VectorDelete):
                self.delete(msg.vector_id, msg.caller)
                return wire.Ok()
            if isinstance(msg, wire.VectorTag):
                return wire.VectorTags(tags=self.set_tags(msg.vector_id, msg.tags, msg.caller))
            if isinstance(msg, wire.VectorTagList):
                return wire.VectorTags(tags=self.visible_tags(msg.caller))
            assert isinstance(msg, wire.VectorLookup)
            ids = [self.resolve(ref, msg.caller) for ref in msg.refs]
            return wire.VectorFound(ids=ids, contents=self.contents(set(ids) - set(msg.cached)))
        except _Unknown as exc:
            return wire.Error(code=NOT_FOUND, message=str(exc))
        except (SteeringError, tags.TagError) as exc:
            return wire.Error(code=INVALID_REQUEST, message=str(exc))
        except quotas.QuotaExceeded as exc:
            return wire.Error(code=RATE_LIMITED, message=exc.message)

    # -- who reaches what ----------------------------------------------------------------------

    def _holds(self, vid: str, user: str) -> bool:
        return self.conn.execute("SELECT 1 FROM steering_vector_holders WHERE vector_id=? AND user=?",
                                 (vid, user)).fetchone() is not None

    def _tagged_for(self, vid: str, who: wire.Principal) -> list[str]:
        rows = self.conn.execute("SELECT tag, owner, public FROM steering_tags WHERE vector_id=? ORDER BY tag", (vid,))
        return [r["tag"] for r in rows if tags.visible(r["owner"], bool(r["public"]), who)]

    def _exists(self, vid: str) -> bool:
        return self.conn.execute("SELECT 1 FROM steering_vectors WHERE vector_id=?", (vid,)).fetchone() is not None

    def _reaches(self, vid: str, who: wire.Principal) -> bool:
        return self._exists(vid) and (who.admin or self._holds(vid, who.user) or bool(self._tagged_for(vid, who)))

    def resolve(self, ref: str, who: wire.Principal) -> str:
        """The id of the vector ``ref`` (an id or a tag) names for ``who``; _Unknown when none."""
        if _ID.fullmatch(ref):
            if self._reaches(ref, who):
                return ref
        else:
            row = self.conn.execute("SELECT vector_id, owner, public FROM steering_tags WHERE tag=?", (ref,)).fetchone()
            if row is not None and tags.visible(row["owner"], bool(row["public"]), who):
                return row["vector_id"]
        raise _Unknown(f"unknown steering vector or tag {ref!r}")

    def reachable(self, who: wire.Principal) -> list[str]:
        """The ids of the vectors ``who`` reaches, newest first."""
        ids = [r[0] for r in self.conn.execute("SELECT vector_id FROM steering_vectors ORDER BY created_at DESC, vector_id")]
        return ids if who.admin else [vid for vid in ids if self._reaches(vid, who)]

    def info(self, vid: str, who: wire.Principal) -> wire.VectorInfo:
        row = self.conn.execute("SELECT hidden_size, layers, norms, created_at FROM steering_vectors WHERE vector_id=?",
                                (vid,)).fetchone()
        return wire.VectorInfo(id=vid, hidden_size=row["hidden_size"], layers=json.loads(row["layers"]),
                               norms=json.loads(row["norms"]), tags=self._tagged_for(vid, who),
                               created_at=row["created_at"])

    def contents(self, ids: set[str]) -> dict[str, bytes]:
        return {vid: bytes(self.conn.execute("SELECT content FROM steering_vectors WHERE vector_id=?",
                                             (vid,)).fetchone()[0]) for vid in sorted(ids)}

    # -- changes -------------------------------------------------------------------------------

    def _check_tags(self, names: list[str], who: wire.Principal) -> list[str]:
        """``names`` if ``who`` may point every one of them (TagError if not); nothing changes."""
        checked = [tags.check_tag(name, who.user, who.admin, kind="vector") for name in names]
        for tag in checked:
            row = self.conn.execute("SELECT owner FROM steering_tags WHERE tag=?", (tag,)).fetchone()
            tags.check_move(tag, None if row is None else row["owner"], who)
        return checked

    def _point(self, names: list[str], vid: str, who: wire.Principal, now: float) -> None:
        for tag in names:
            row = self.conn.execute("SELECT owner, public FROM steering_tags WHERE tag=?", (tag,)).fetchone()
            owner, public = tags.new_tag(who) if row is None else (row["owner"], bool(row["public"]))
            self.conn.execute("INSERT OR REPLACE INTO steering_tags (tag, vector_id, owner, public, updated_at,"
                              " updated_by) VALUES (?,?,?,?,?,?)", (tag, vid, owner, int(public), now, who.user))

    def put(self, content: bytes, names: list[str], who: wire.Principal) -> wire.VectorInfo:
        vector = decode(content)  # (SteeringError: not canonical)
        vid = vector_id(content)
        now = time.time()
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            checked = self._check_tags(names, who)
            if not self._holds(vid, who.user):
                held = self.conn.execute("SELECT COUNT(*) FROM steering_vector_holders WHERE user=?",
                                         (who.user,)).fetchone()[0]
                quotas.check("max_vectors_per_user", self.limits.max_vectors_per_user, who.user, held, 1,
                             "steering vectors", section="steering")
            self.conn.execute(
                "INSERT OR IGNORE INTO steering_vectors (vector_id, content, hidden_size, layers, norms, created_at)"
                " VALUES (?,?,?,?,?,?)",
                (vid, content, vector.hidden_size, json.dumps(vector.layers), json.dumps(list(vector.norms().values())),
                 now))
            self.conn.execute("INSERT OR IGNORE INTO steering_vector_holders (vector_id, user, uploaded_at) VALUES"
                              " (?,?,?)", (vid, who.user, now))
            self._point(checked, vid, who, now)
        return self.info(vid, who)

    def set_tags(self, vid: str, names: list[str], who: wire.Principal) -> list[wire.VectorTagInfo]:
        if not self._reaches(vid, who):
            raise _Unknown(f"unknown steering vector {vid!r}")
        if not names:
            raise tags.TagError("tags must be a non-empty list of strings")
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            checked = self._check_tags(names, who)
            self._point(checked, vid, who, time.time())
        rows = (self.conn.execute("SELECT * FROM steering_tags WHERE tag=?", (tag,)).fetchone() for tag in checked)
        return [self._tag_info(row) for row in rows]

    def delete(self, vid: str, who: wire.Principal) -> None:
        if not (self._holds(vid, who.user) or (who.admin and self._exists(vid))):
            raise _Unknown(f"no steering vector {vid!r} to delete (unknown, or not uploaded by you)")
        with transaction(self.conn, "BEGIN IMMEDIATE"):
            if not who.admin:
                self.conn.execute("DELETE FROM steering_vector_holders WHERE vector_id=? AND user=?", (vid, who.user))
                self.conn.execute("DELETE FROM steering_tags WHERE vector_id=? AND owner=?", (vid, who.user))
            held = self.conn.execute("SELECT 1 FROM steering_vector_holders WHERE vector_id=?", (vid,)).fetchone()
            if who.admin or held is None:  # (its holders and tags go with it: ON DELETE CASCADE)
                self.conn.execute("DELETE FROM steering_vectors WHERE vector_id=?", (vid,))

    # -- tags ----------------------------------------------------------------------------------

    @staticmethod
    def _tag_info(row: sqlite3.Row) -> wire.VectorTagInfo:
        return wire.VectorTagInfo(tag=row["tag"], vector_id=row["vector_id"], updated_at=row["updated_at"],
                                  updated_by=row["updated_by"])

    def visible_tags(self, who: wire.Principal) -> list[wire.VectorTagInfo]:
        rows = self.conn.execute("SELECT * FROM steering_tags ORDER BY updated_at DESC, tag")
        return [self._tag_info(r) for r in rows if tags.visible(r["owner"], bool(r["public"]), who)]
