"""Stored responses (`store: true`) in an embedded SQLite database, for previous_response_id and GET /v1/responses/{id}.

In memory by default; with --response-store PATH a file in WAL mode, so several server processes (the
replicas of one `serve --replicas`) share it. Bounded by a count and an age: each insert first drops what
is older than the TTL, then the oldest rows beyond the count. Expired rows are invisible even before that.

A row keeps the response object as it was returned, this turn's input items, the whole conversation as
chat messages (without the instructions, which are not carried over), a key of the instructions and tools
it was rendered with, and the exact token ids of its prompt and output: a follow-up that resends the same
instructions and tools starts its prompt with exactly those tokens, so the radix cache holds all of it.
"""
from __future__ import annotations

import sqlite3
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any

import orjson

from ..scheduler.fair_share import DEFAULT_TENANT

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    body BLOB NOT NULL,
    prompt_ids BLOB NOT NULL,
    output_ids BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    created_at: float
    response: dict[str, Any]  # the response object, as GET returns it
    input_items: list[dict[str, Any]]  # this turn's input
    conversation: list[dict[str, Any]]  # chat messages of the whole conversation, this output included
    context_key: str  # the instructions and tools the prompt was rendered with
    prompt_ids: list[int]
    output_ids: list[int]
    session_id: str | None = None  # the chain's session: its turns keep the history pinned between them
    tenant: str = DEFAULT_TENANT  # who made it (frontend/tenants.py): only its own lookups find it


LOCK_TIMEOUT_S = 10.0


def _enable_wal(db: sqlite3.Connection) -> None:
    """Switch a file database to WAL (persistent: a file already in WAL is left as is). Switching needs the
    file to itself, and SQLite answers "database is locked" at once rather than waiting in its busy
    handler, so processes opening one file together (the replicas' workers) retry here."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class ResponseStore:
    def __init__(self, path: str | None, max_items: int, ttl_s: float, clock: Any = time.time) -> None:
        self.path, self.max_items, self.ttl_s, self._clock = path, max_items, ttl_s, clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path or ":memory:", check_same_thread=False, isolation_level=None,
                                   timeout=LOCK_TIMEOUT_S)
        if path:
            _enable_wal(self._db)
        self._db.executescript(_SCHEMA)

    def put(self, r: StoredResponse) -> None:
        body = orjson.dumps({"response": r.response, "input_items": r.input_items,
                             "conversation": r.conversation, "context_key": r.context_key,
                             "session_id": r.session_id, "tenant": r.tenant})
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                                 (r.id, r.created_at, body, _pack(r.prompt_ids), _pack(r.output_ids)))
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, response_id: str, tenant: str | None = None) -> StoredResponse | None:
        """The stored response, or None (none, expired, or made by another tenant than `tenant`; None: anyone's)."""
        with self._lock:
            row = self._db.execute("SELECT id, created_at, body, prompt_ids, output_ids FROM responses "
                                   "WHERE id = ? AND created_at >= ?", (response_id, self._oldest())).fetchone()
        if row is None:
            return None
        body = orjson.loads(row[2])
        owner = body.get("tenant", DEFAULT_TENANT)
        if tenant is not None and owner != tenant:
            return None
        return StoredResponse(id=row[0], created_at=row[1], response=body["response"],
                              input_items=body["input_items"], conversation=body["conversation"],
                              context_key=body["context_key"], prompt_ids=_unpack(row[3]), output_ids=_unpack(row[4]),
                              session_id=body.get("session_id"), tenant=owner)

    def delete(self, response_id: str, tenant: str | None = None) -> bool:
        """Delete it if it is there and `tenant`'s (None: anyone's); whether it was."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT body FROM responses WHERE id = ? AND created_at >= ?",
                                       (response_id, self._oldest())).fetchone()
                mine = row is not None and (tenant is None
                                            or orjson.loads(row[0]).get("tenant", DEFAULT_TENANT) == tenant)
                if mine:
                    self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return mine

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses WHERE created_at >= ?",
                                    (self._oldest(),)).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _oldest(self) -> float:
        return self._clock() - self.ttl_s

    def _evict(self) -> None:
        self._db.execute("DELETE FROM responses WHERE created_at < ?", (self._oldest(),))
        self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC, "
                         "rowid DESC LIMIT -1 OFFSET ?)", (self.max_items,))


def _pack(ids: list[int]) -> bytes:
    return array("i", ids).tobytes()


def _unpack(raw: bytes) -> list[int]:
    out = array("i")
    out.frombytes(raw)
    return out.tolist()
