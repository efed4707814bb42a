"""The ledger's connections: the SQLAlchemy engine and sessions, the raw sqlite3 hot-path
connection, the pragmas and the write lock.

Owns :class:`LedgerBase` (opening and upgrading the file with its modes, ``_tx`` / ``_read``
sessions, the process-wide ``_write_lock``, the hot connection under ``_hot_lock`` with
``synchronous=NORMAL``, ``_stamp`` for plain-SQL timestamps, ``close``), :func:`utcnow` and
the pragmas every connection gets (WAL, ``synchronous=FULL``, foreign keys, busy timeout).
Why the hot connection may skip the WAL fsync is told in the package docstring
(:mod:`segnode.storage.ledger`).

Must not touch: any table's rows (beyond the schema-version row written at creation); the
queries live in the modules of their concern, which all build on :class:`LedgerBase`.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from segnode.storage.migrations import upgrade
from segnode.storage.models import SCHEMA_VERSION, Base, Meta

# The logger keeps the name it had when the ledger was one module.
log = logging.getLogger("segnode.storage.ledger")


def utcnow() -> datetime:
    """Naive UTC timestamp (SQLite stores no zone)."""
    return datetime.now(UTC).replace(tzinfo=None)


class LedgerBase:
    """The ledger's file and connections, shared by every part of
    :class:`~segnode.storage.ledger.Ledger`.

    Parameters
    ----------
    path
        The database file; its folder is created with mode 0700.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        # Create the file 0600 before SQLite opens it: its -wal and -shm files take its mode.
        os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(path, 0o600)
        self.engine: Engine = create_engine(
            f"sqlite:///{path}",
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=16,
        )
        event.listen(self.engine, "connect", _sqlite_pragmas)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()
        # The SCP's per-instance statements go through one plain sqlite3 connection (an
        # eighth of SQLAlchemy's per-statement cost); used under _hot_lock, after _write_lock
        # when writing.
        self._hot: sqlite3.Connection | None = None
        self._hot_lock = threading.Lock()
        self._datetime_bind: Any = None
        # An older ledger is upgraded in place before anything reads it; a newer one stops
        # here (segnode.storage.migrations.SchemaError).
        found = upgrade(path)
        if found is not None and found != SCHEMA_VERSION:
            log.info("ledger %s upgraded from schema version %d to %d", path, found, SCHEMA_VERSION)
        Base.metadata.create_all(self.engine)
        os.chmod(path, 0o600)
        with self._tx() as s:
            if s.get(Meta, "schema_version") is None:
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))

    def _stamp(self, when: datetime) -> str:
        """``when`` as the dialect stores DateTime columns (for the plain-SQL hot path)."""
        if self._datetime_bind is None:
            impl = DateTime().dialect_impl(self.engine.dialect)
            self._datetime_bind = impl.bind_processor(self.engine.dialect)
        return str(self._datetime_bind(when) if self._datetime_bind else when.isoformat(" "))

    def close(self) -> None:
        """Dispose of the connection pool."""
        with self._hot_lock:
            if self._hot is not None:
                self._hot.close()
                self._hot = None
        self.engine.dispose()

    def _hot_connection(self) -> sqlite3.Connection:
        """The hot-path connection (autocommit mode: transactions are explicit); call under
        ``_hot_lock``."""
        if self._hot is None:
            conn = sqlite3.connect(
                self.path, timeout=30, check_same_thread=False, isolation_level=None
            )
            _sqlite_pragmas(conn, None)
            # Instance rows: no WAL fsync per commit (see the package docstring); the spool
            # file is the durable record, and start-up re-records files without a row.
            conn.execute("PRAGMA synchronous=NORMAL")
            self._hot = conn
        return self._hot

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._write_lock, self._session.begin() as s:
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._session() as s:
            yield s


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()
