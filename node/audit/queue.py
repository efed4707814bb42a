"""The audit queue: a durable, bounded, ordered store of encoded audit messages in its own
SQLite file (``<data_dir>/audit.sqlite``), with one cursor per destination.

An enqueued message is committed in WAL mode with ``synchronous=FULL`` before
:meth:`AuditQueue.enqueue` returns, so it survives the process being killed and a power cut.
Each destination reads the messages after its cursor, in sequence order, and moves the cursor
only once it has sent them (:meth:`AuditQueue.ack`): every destination gets every message
once and in order. Messages every cursor has passed are deleted. The queue holds at most
``max_messages``; when full it either drops the oldest (``drop_oldest``, counted and logged
once per overflow episode) or refuses new messages (``refuse``, :meth:`AuditQueue.full`).

The ledger is not used: audit messages must be recorded even while the ledger is down, and
their volume must not slow it.

Must not touch: the message content and the sending.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ON_FULL = ("drop_oldest", "refuse")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    severity INTEGER NOT NULL,
    payload BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS cursors (
    destination TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class QueuedMessage:
    """One stored message: its sequence number, creation time (epoch seconds), syslog
    severity and encoded payload."""

    seq: int
    created: float
    severity: int
    payload: bytes


class AuditQueue:
    """The durable queue (see the module docstring).

    Parameters
    ----------
    path
        The SQLite file; created with its folder when missing.
    destinations
        The destinations' keys (their URLs). A new destination starts with the messages still
        stored; the cursor of one no longer listed is removed, so that it holds nothing back.
    max_messages
        The bound.
    on_full
        ``"drop_oldest"`` or ``"refuse"``.

    Notes
    -----
    One connection serves all threads behind a lock: every operation is one short transaction.
    """

    def __init__(
        self,
        path: Path,
        destinations: Sequence[str],
        *,
        max_messages: int,
        on_full: str = "drop_oldest",
    ) -> None:
        if max_messages < 1:
            raise ValueError("the audit queue's bound must be at least 1")
        if on_full not in ON_FULL:
            raise ValueError(f"on_full must be one of {ON_FULL}, not {on_full!r}")
        self.path, self.max_messages, self.on_full = path, max_messages, on_full
        self.dropped = 0
        self.refused = 0
        self._overflowing = False
        # An overflow episode ends once the queue is back under 90 % of its bound, so that a
        # queue hovering at the bound does not log a warning for every message.
        self._low_water = min(max_messages - 1, int(max_messages * 0.9))
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        with self._transaction():
            keys = list(destinations)
            marks = ",".join("?" * len(keys))
            self._db.execute(f"DELETE FROM cursors WHERE destination NOT IN ({marks})", keys)
            start = self._db.execute(
                "SELECT COALESCE((SELECT MIN(seq) - 1 FROM messages),"
                " (SELECT seq FROM sqlite_sequence WHERE name = 'messages'), 0)"
            ).fetchone()[0]
            self._db.executemany(
                "INSERT OR IGNORE INTO cursors (destination, last_seq) VALUES (?, ?)",
                [(key, start) for key in keys],
            )
            self._trim()

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    def _count(self) -> int:
        # Rows go only from the bottom (trimming, dropping), so they are one contiguous range.
        low, high = self._db.execute("SELECT MIN(seq), MAX(seq) FROM messages").fetchone()
        return 0 if low is None else int(high) - int(low) + 1

    def _trim(self) -> None:
        self._db.execute("DELETE FROM messages WHERE seq <= (SELECT MIN(last_seq) FROM cursors)")

    def enqueue(self, payload: bytes, severity: int, created: float | None = None) -> bool:
        """Store ``payload`` durably; False when the queue is full and refuses (``refuse``).

        With ``drop_oldest`` a full queue deletes its oldest messages to make room.
        """
        when = time.time() if created is None else created
        with self._lock, self._transaction():
            count = self._count()
            if count >= self.max_messages:
                if self.on_full == "refuse":
                    self.refused += 1
                    self._overflow(f"refusing new audit messages ({count} queued)")
                    return False
                excess = count - self.max_messages + 1
                self._db.execute(
                    "DELETE FROM messages WHERE seq IN"
                    " (SELECT seq FROM messages ORDER BY seq LIMIT ?)",
                    (excess,),
                )
                self.dropped += excess
                self._overflow(f"dropping the oldest audit messages ({self.dropped} so far)")
            elif self._overflowing and count <= self._low_water:
                self._recovered(count)
            self._db.execute(
                "INSERT INTO messages (created, severity, payload) VALUES (?, ?, ?)",
                (when, severity, payload),
            )
            return True

    def _overflow(self, what: str) -> None:
        if not self._overflowing:
            self._overflowing = True
            log.warning(
                "AUDIT QUEUE FULL: %d messages (the bound), the audit destinations are not "
                "taking them: %s",
                self.max_messages,
                what,
            )

    def _recovered(self, count: int) -> None:
        self._overflowing = False
        log.warning(
            "audit queue below its bound again (%d queued); %d dropped and %d refused so far",
            count,
            self.dropped,
            self.refused,
        )

    def full(self) -> bool:
        """Whether the queue holds its bound."""
        with self._lock:
            count = self._count()
            if self._overflowing and count <= self._low_water:
                self._recovered(count)
            return count >= self.max_messages

    def count(self) -> int:
        """How many messages are stored."""
        with self._lock:
            return self._count()

    def pending(self, destination: str) -> int:
        """How many stored messages ``destination`` has not been sent."""
        with self._lock:
            row = self._db.execute(
                "SELECT COUNT(*) FROM messages WHERE seq >"
                " (SELECT last_seq FROM cursors WHERE destination = ?)",
                (destination,),
            ).fetchone()
            return int(row[0])

    def fetch(self, destination: str, limit: int) -> list[QueuedMessage]:
        """Up to ``limit`` messages after ``destination``'s cursor, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, created, severity, payload FROM messages WHERE seq >"
                " (SELECT last_seq FROM cursors WHERE destination = ?) ORDER BY seq LIMIT ?",
                (destination, limit),
            ).fetchall()
        return [QueuedMessage(int(s), float(c), int(v), bytes(p)) for s, c, v, p in rows]

    def ack(self, destination: str, seq: int) -> None:
        """``destination`` has been sent every message up to ``seq``: move its cursor there and
        delete what every destination has been sent."""
        with self._lock, self._transaction():
            self._db.execute(
                "UPDATE cursors SET last_seq = MAX(last_seq, ?) WHERE destination = ?",
                (seq, destination),
            )
            self._trim()

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()


class _Transaction:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an exception)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")
