"""Schema migrations of the ledger: an older ledger file is upgraded in place when it is opened.

The ledger's version is the ``schema_version`` row of the ``meta`` table
(:data:`segnode.storage.models.SCHEMA_VERSION` for the code). Each step in :data:`STEPS` takes a
ledger from version ``n`` to ``n + 1``; :func:`upgrade` runs every step a ledger is missing,
and stamps the new version, in one SQLite transaction (SQLite's DDL is transactional), so a
crash during an upgrade leaves the old version intact. The transaction is ``BEGIN IMMEDIATE``:
two processes opening an old ledger at once (``segnode serve`` and ``segnode jobs``) upgrade
it once, the second finding it done.

A step only adds: new nullable columns, new indexes. Tables that are new in a version need
no step (:meth:`sqlalchemy.schema.MetaData.create_all` adds missing tables).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from segnode.storage.models import SCHEMA_VERSION

#: ``STEPS[n]``: the statements that take a version ``n`` ledger to version ``n + 1``.
STEPS: dict[int, tuple[str, ...]] = {
    # 2: when the outbox started sending each delivery (the send stage of `segnode jobs`).
    1: ("ALTER TABLE deliveries ADD COLUMN sending_at DATETIME",),
}


class SchemaError(RuntimeError):
    """The ledger's schema is newer than this segnode, or has no upgrade path."""


def upgrade(path: Path) -> int | None:
    """Bring the ledger at ``path`` to :data:`SCHEMA_VERSION`; return the version it had.

    Returns None for a new ledger (no ``meta`` row yet: the caller creates the tables at the
    current version).

    Raises
    ------
    SchemaError
        If the ledger is newer than this code, or a step is missing.
    """
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout=30000")
        conn.execute("BEGIN IMMEDIATE")
        try:
            found = _version(conn)
            if found is not None and found < SCHEMA_VERSION:
                for version in range(found, SCHEMA_VERSION):
                    if version not in STEPS:
                        raise SchemaError(
                            f"ledger {path} has schema version {found} and there is no "
                            f"migration from version {version}; use another data directory"
                        )
                    for statement in STEPS[version]:
                        conn.execute(statement)
                conn.execute(
                    "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        conn.close()
    if found is not None and found > SCHEMA_VERSION:
        raise SchemaError(
            f"ledger {path} has schema version {found}, newer than this segnode's "
            f"{SCHEMA_VERSION}; upgrade segnode or use another data directory"
        )
    return found


def _version(conn: sqlite3.Connection) -> int | None:
    """The ``schema_version`` of the ledger, None when it has none yet."""
    has_meta = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
    ).fetchone()
    if has_meta is None:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


__all__ = ["STEPS", "SchemaError", "upgrade"]
