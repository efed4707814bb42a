"""Schema migrations of the ledger, with Alembic, for SQLite and PostgreSQL.

Owns the Alembic environment (``env.py``), the revisions (``versions/``, one per
:data:`~segnode.storage.models.SCHEMA_VERSION`: revision ``0002`` is schema version 2) and
the three calls the ledger and the CLI make: :func:`upgrade` (to the newest revision),
:func:`check` (refuse a schema this code does not know, or one that is behind) and
:func:`revision` (what a ledger has).

Every upgrade runs in one transaction (both databases' DDL is transactional), so a crash
during an upgrade leaves the old version intact. On SQLite the transaction is
``BEGIN IMMEDIATE``: two processes opening an old ledger at once (``segnode serve`` and
``segnode jobs``) upgrade it once, the second finding it done. On PostgreSQL an advisory lock
does the same for nodes running ``segnode db upgrade`` at once.

The ``meta`` table's ``schema_version`` row is kept beside Alembic's ``alembic_version``:
segnode releases from before Alembic read it and refuse a newer ledger. A ledger made by
those releases (a ``meta`` row and no ``alembic_version``) is stamped with the revision of its
version, then upgraded.

Must not touch: rows other than ``meta`` and ``alembic_version``; the tables' use is the
ledger's (:mod:`segnode.storage.ledger`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, create_engine, event, inspect, make_url, text
from sqlalchemy.pool import NullPool

from segnode.storage.models import SCHEMA_VERSION

if TYPE_CHECKING:  # Alembic is imported only when a schema changes (0.1 s at every start)
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory

#: The folder of ``env.py`` and ``versions/``.
SCRIPTS = Path(__file__).parent
#: A constant key for PostgreSQL's advisory lock around an upgrade ("segn" in ASCII).
_PG_LOCK = 0x7365676E


class SchemaError(RuntimeError):
    """The ledger's schema is newer than this segnode, unknown to it, or behind it."""


@dataclass(frozen=True)
class Revision:
    """What a ledger's schema is: Alembic's revision and the ``meta`` version."""

    alembic: str | None
    version: int | None

    @property
    def empty(self) -> bool:
        """A database with no ledger in it yet."""
        return self.alembic is None and self.version is None


def revision_of(version: int) -> str:
    """The Alembic revision id of a schema version (``2`` -> ``"0002"``)."""
    return f"{version:04d}"


HEAD = revision_of(SCHEMA_VERSION)


def _config(connection: Connection) -> AlembicConfig:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(SCRIPTS))
    cfg.attributes["connection"] = connection
    return cfg


def _script() -> ScriptDirectory:
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(SCRIPTS))
    return ScriptDirectory.from_config(cfg)


def _read(connection: Connection) -> Revision:
    tables = set(inspect(connection).get_table_names())
    alembic = None
    if "alembic_version" in tables:
        row = connection.execute(text("SELECT version_num FROM alembic_version")).first()
        alembic = None if row is None else str(row[0])
    version = None
    if "meta" in tables:
        row = connection.execute(
            text("SELECT value FROM meta WHERE key = 'schema_version'")
        ).first()
        version = None if row is None else int(row[0])
    return Revision(alembic, version)


def revision(engine: Engine) -> Revision:
    """What the ledger behind ``engine`` has (nothing for an empty database)."""
    with engine.connect() as conn:
        return _read(conn)


def _refuse_unknown(found: Revision, where: str) -> None:
    if found.version is not None and found.version > SCHEMA_VERSION:
        raise SchemaError(
            f"ledger {where} has schema version {found.version}, newer than this segnode's "
            f"{SCHEMA_VERSION}; upgrade segnode or use another ledger"
        )
    if found.alembic is not None and found.alembic != HEAD:
        from alembic.util import CommandError

        try:
            known = _script().get_revision(found.alembic)
        except CommandError:
            known = None
        if known is None:
            raise SchemaError(
                f"ledger {where} has schema revision {found.alembic!r}, unknown to this "
                f"segnode (newest it knows: {HEAD}); upgrade segnode or use another ledger"
            )


def check(engine: Engine, where: str) -> Revision:
    """Refuse a ledger that is not at this code's revision; return what it has.

    Raises
    ------
    SchemaError
        If the schema is newer or unknown, or behind (``segnode db upgrade`` makes it current).
    """
    found = revision(engine)
    _refuse_unknown(found, where)
    if found.alembic != HEAD:
        has = (
            "no ledger tables"
            if found.empty
            else f"schema revision {found.alembic or found.version}"
        )
        raise SchemaError(
            f"ledger {where} has {has}, this segnode needs {HEAD}; "
            "run `segnode db upgrade` (once, from one node) and start again"
        )
    return found


def upgrade(engine: Engine, where: str) -> Revision:
    """Bring the ledger behind ``engine`` to :data:`HEAD` (creating it when empty); return
    what it had before.

    Raises
    ------
    SchemaError
        If the ledger is newer than this code or has a revision it does not know; nothing is
        changed then.
    """
    found = revision(engine) if _exists(engine) else Revision(None, None)
    if found.alembic == HEAD and found.version == SCHEMA_VERSION:
        return found  # current: nothing to lock, nothing to import
    from alembic import command

    migrate = _migration_engine(engine)
    try:
        with migrate.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
            found = _read(conn)
            _refuse_unknown(found, where)
            cfg = _config(conn)
            if found.alembic is None and found.version is not None:
                # Made before Alembic: its meta version names its revision.
                command.stamp(cfg, revision_of(found.version))
            if found.alembic != HEAD:
                command.upgrade(cfg, HEAD)
            return found
    finally:
        if migrate is not engine:
            migrate.dispose()


def _exists(engine: Engine) -> bool:
    """Whether there may be a ledger to read (an SQLite file that is not empty)."""
    if engine.dialect.name != "sqlite":
        return True
    path = engine.url.database
    return path is not None and Path(path).exists() and Path(path).stat().st_size > 0


def upgrade_database(url: str) -> Revision:
    """:func:`upgrade` the ledger at a SQLAlchemy URL (``segnode db upgrade``); return what it
    had before."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        return upgrade(engine, make_url(url).render_as_string(hide_password=True))
    finally:
        engine.dispose()


def _migration_engine(engine: Engine) -> Engine:
    """For SQLite, an engine whose transactions are ``BEGIN IMMEDIATE`` (pysqlite would
    otherwise run the DDL outside any transaction); PostgreSQL's own engine as it is."""
    if engine.dialect.name != "sqlite":
        return engine
    migrate = create_engine(engine.url, connect_args={"timeout": 30}, poolclass=NullPool)

    @event.listens_for(migrate, "connect")
    def _autocommit(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        dbapi_conn.isolation_level = None
        dbapi_conn.execute("PRAGMA busy_timeout=30000")
        dbapi_conn.execute("PRAGMA journal_mode=WAL")  # persistent: the ledger's from its birth

    @event.listens_for(migrate, "begin")
    def _begin(conn):  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return migrate


def set_version(connection: Connection, version: int) -> None:
    """Write ``meta.schema_version`` (each revision's last step)."""
    done = connection.execute(
        text("UPDATE meta SET value = :v WHERE key = 'schema_version'"), {"v": str(version)}
    )
    if done.rowcount == 0:
        connection.execute(
            text("INSERT INTO meta (key, value) VALUES ('schema_version', :v)"),
            {"v": str(version)},
        )


__all__ = [
    "HEAD",
    "Revision",
    "SchemaError",
    "check",
    "revision",
    "revision_of",
    "set_version",
    "upgrade",
    "upgrade_database",
]
