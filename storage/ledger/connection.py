"""The ledger's connections: the SQLAlchemy engine and sessions, the hot-path connection, the
pragmas and the write lock, on SQLite (the embedded default) or PostgreSQL.

Owns :class:`LedgerBase` (opening the database, creating or upgrading an SQLite file and
checking a PostgreSQL schema, ``_tx`` / ``_read`` sessions, the process-wide ``_write_lock``,
the hot connection under ``_hot_lock``, ``_sql`` and ``_stamp`` for the plain-SQL hot path,
``close``), :class:`HotConnection` (one plain DB-API connection, sqlite3 with
``synchronous=NORMAL`` or psycopg, in autocommit mode with explicit transactions),
:func:`utcnow` and the pragmas every SQLite connection gets (WAL, ``synchronous=FULL``,
foreign keys, busy timeout). Why the SQLite hot connection may skip the WAL fsync is told in
the package docstring (:mod:`segnode.storage.ledger`).

Must not touch: any table's rows; the queries live in the modules of their concern, which all
build on :class:`LedgerBase`; the schema's versions are :mod:`segnode.storage.migrations`'.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import DateTime, create_engine, event, func, make_url, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from segnode.storage import migrations
from segnode.storage.durable import ensure_folder, fsync_folder
from segnode.storage.models import SCHEMA_VERSION, Node

# The logger keeps the name it had when the ledger was one module.
log = logging.getLogger("segnode.storage.ledger")


def utcnow() -> datetime:
    """Naive UTC timestamp (SQLite stores no zone)."""
    return datetime.now(UTC).replace(tzinfo=None)


#: What every session of a node asks of a PostgreSQL server (libpq ``options``): probe the
#: connection after 10 s without traffic, then every 5 s, and end it after 3 unanswered
#: probes. A node that loses power (or its network) sends no FIN; without these the server
#: keeps its sessions until the operating system's keepalive ends them (Linux: 7200 s, then 9
#: probes 75 s apart), and with them the advisory lock on the node's name (it cannot start
#: again: :meth:`~segnode.storage.ledger.nodes.NodeStore.join`) and the row locks of a
#: transaction it had open.
SESSION_OPTIONS = "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"


def session_options(url: str) -> str:
    """libpq ``options`` for a session on the PostgreSQL ledger at ``url``:
    :data:`SESSION_OPTIONS`, then the URL's own ``options`` (a setting given there wins)."""
    own = make_url(url).query.get("options", "")
    return " ".join([SESSION_OPTIONS, *([own] if isinstance(own, str) else own)]).strip()


def libpq_conninfo(url: str) -> str:
    """A ``postgresql+psycopg://`` SQLAlchemy URL as libpq (psycopg) takes it, without its
    ``options`` (rendered into a URL again, their spaces would become ``+``): pass
    :func:`session_options` as psycopg's ``options``."""
    plain = make_url(url).set(drivername="postgresql").difference_update_query(["options"])
    return plain.render_as_string(hide_password=False)


#: The longest the SCP's per-instance write waits for the ledger (this process's write lock,
#: then SQLite's, which another process may hold): the sender gets 0xA700 well inside the
#: common 10-30 s DIMSE timeouts instead of waiting the 30 s the other writers may.
HOT_WAIT_S = 5.0

#: How long every other SQLite connection waits for another writer.
SQLITE_BUSY_S = 30.0


class LedgerBusy(RuntimeError):
    """The ledger's write lock was not had within :data:`HOT_WAIT_S`."""


class LedgerInUse(RuntimeError):
    """Another process runs as this node on the ledger
    (:meth:`~segnode.storage.ledger.nodes.NodeStore.join`)."""


class LedgerBase:
    """The ledger's database and connections, shared by every part of
    :class:`~segnode.storage.ledger.Ledger`.

    Parameters
    ----------
    path
        The SQLite file; its folder is created with mode 0700. An older ledger is upgraded
        in place when opened.
    url
        Instead of ``path``: a SQLAlchemy URL, ``postgresql+psycopg://user@host/db`` (whose
        schema must be current: ``segnode db upgrade``) or ``sqlite:///FILE``.

    Raises
    ------
    segnode.storage.migrations.SchemaError
        If the schema is newer than this code or unknown to it, or (PostgreSQL) behind it.
    """

    def __init__(self, path: Path | None = None, *, url: str | None = None) -> None:
        if url and make_url(url).get_backend_name() == "sqlite":
            path, url = Path(make_url(url).database or ""), None
        self.path: Path | None = path
        if url:
            self.url = url
            self.where = make_url(url).render_as_string(hide_password=True)
            self.engine: Engine = create_engine(
                url,
                pool_size=8,
                max_overflow=16,
                pool_pre_ping=True,
                connect_args={"options": session_options(url)},
            )
        else:
            if path is None:
                raise ValueError("a ledger needs a path or a URL")
            ensure_folder(path.parent)  # a new folder's name durable (its parent's fsync)
            # Create the file 0600 before SQLite opens it: its -wal and -shm files take its mode.
            # SQLite syncs the folder when it creates a journal or WAL, never for the database
            # file itself: a new ledger's name is made durable here.
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            except FileExistsError:
                pass
            else:
                fsync_folder(path.parent)
            os.chmod(path, 0o600)
            self.url = f"sqlite:///{path}"
            self.where = str(path)
            self.engine = create_engine(
                self.url,
                creator=lambda: _open_sqlite(self.path, SQLITE_BUSY_S),
                pool_size=8,
                max_overflow=16,
            )
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.dialect = self.engine.dialect.name
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        self._write_lock = threading.RLock()
        # The SCP's per-instance statements go through one plain DB-API connection (an
        # eighth of SQLAlchemy's per-statement cost); used under _hot_lock, after _write_lock
        # when writing.
        self._hot: HotConnection | None = None
        self._hot_lock = threading.Lock()
        self._node_lock: Any = None  # PostgreSQL: the connection holding the node's name
        #: The node this process runs as (``join``); None for the CLI, which claims nothing.
        self.node_name: str | None = None
        #: How long a node's heartbeat vouches for what it claimed (``join``).
        self.lease = timedelta(seconds=30)
        self._listener: threading.Thread | None = None  # NodeStore.listen
        self._listening = threading.Event()  # set: the listener stops
        self._datetime_bind: Any = None
        self._statements: dict[str, str] = {}
        try:
            if self.path is not None:
                # The embedded ledger is created, or upgraded in place, when opened; a newer
                # one stops here (SchemaError).
                found = migrations.upgrade(self.engine, self.where)
                if found.version is not None and found.version != SCHEMA_VERSION:
                    log.info(
                        "ledger %s upgraded from schema version %d to %d",
                        self.where,
                        found.version,
                        SCHEMA_VERSION,
                    )
                os.chmod(self.path, 0o600)
            else:
                # A shared ledger changes only by `segnode db upgrade`, run once on purpose.
                migrations.check(self.engine, self.where)
        except BaseException:
            self.engine.dispose()
            raise
        # The file this process opened (the connections keep writing to it whatever the path
        # names later): see gone().
        self._identity = None if self.path is None else _identity(self.path)

    def gone(self) -> str | None:
        """Why the SQLite file this process writes is no longer the ledger at its path, or
        None: deleted (the connections would go on writing to a file no other process can
        open, and lose it all at exit) or replaced by another file. Always None on
        PostgreSQL."""
        if self.path is None:
            return None
        try:
            now = _identity(self.path)
        except FileNotFoundError:
            return f"the ledger {self.path} was deleted while the node ran"
        except OSError:
            return None  # not a verdict: asked again at the next tick
        if now != self._identity:
            return f"the ledger {self.path} was replaced by another file while the node ran"
        return None

    def _stamp(self, when: datetime) -> str | datetime:
        """``when`` as the dialect stores DateTime columns (for the plain-SQL hot path)."""
        if self.dialect != "sqlite":
            return when  # psycopg sends a datetime as a timestamp
        if self._datetime_bind is None:
            impl = DateTime().dialect_impl(self.engine.dialect)
            self._datetime_bind = impl.bind_processor(self.engine.dialect)
        return str(self._datetime_bind(when) if self._datetime_bind else when.isoformat(" "))

    def clock(self) -> Any:
        """Now, as the ledger's clock tells it (naive UTC), for heartbeats and leases: the
        database server's on PostgreSQL, so that nodes whose clocks differ agree on whose
        heartbeat has expired; this process's on SQLite (one node)."""
        if self.dialect == "postgresql":
            return func.timezone("UTC", func.statement_timestamp(), type_=DateTime())
        return utcnow()

    def _clock_value(self, s: Session) -> datetime:
        """:meth:`clock` as a value, read in session ``s``."""
        now = self.clock()
        if isinstance(now, datetime):
            return now
        value = s.scalar(select(now))
        assert isinstance(value, datetime)
        return value

    def _live_nodes(self) -> Any:
        """The names of the nodes whose heartbeat is younger than the lease (a subquery)."""
        return select(Node.name).where(Node.heartbeat_at > self.clock() - self.lease)

    def _sql(self, statement: str) -> str:
        """A plain statement written with ``?`` placeholders, in the driver's paramstyle
        (psycopg's ``%s``); for the hot connection and ``exec_driver_sql``."""
        if self.dialect == "sqlite":
            return statement
        done = self._statements.get(statement)
        if done is None:
            done = self._statements[statement] = statement.replace("?", "%s")
        return done

    def close(self) -> None:
        """Close the hot connection (and the node lock, and stop listening) and dispose of
        the connection pool."""
        self._listening.set()
        if self._listener is not None:
            self._listener.join(5)
            self._listener = None
        with self._hot_lock:
            if self._hot is not None:
                self._hot.close()
                self._hot = None
        if self._node_lock is not None:
            self._node_lock.close()
            self._node_lock = None
        self.engine.dispose()

    def _hot_connection(self) -> HotConnection:
        """The hot-path connection (autocommit mode: transactions are explicit); call under
        ``_hot_lock``."""
        if self._hot is not None and self._hot.broken:
            log.warning("ledger connection lost; connecting again")
            self._hot.close()
            self._hot = None
        if self._hot is None:
            if self.path is not None:
                self._hot = HotConnection.sqlite(self.path)
            else:
                self._hot = HotConnection.postgresql(self.url)
        return self._hot

    @contextmanager
    def _hot_write(self) -> Iterator[None]:
        """This process's write lock for the SCP's hot path, waited for at most
        :data:`HOT_WAIT_S` (:class:`LedgerBusy`): while another writer waits on a ledger
        that another process locked, every association's C-STORE queues behind it."""
        if not self._write_lock.acquire(timeout=HOT_WAIT_S):
            raise LedgerBusy(
                f"the ledger stayed busy for {HOT_WAIT_S:g} s (another writer, or another "
                "process holding its write lock)"
            )
        try:
            yield
        finally:
            self._write_lock.release()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._write_lock, self._session.begin() as s:
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._session() as s:
            yield s


class HotConnection:
    """One plain DB-API connection in autocommit mode, for the statements run per instance.

    Statements are given in the driver's paramstyle (:meth:`LedgerBase._sql`); transactions
    are explicit (:meth:`begin`, :meth:`commit`, :meth:`rollback`). ``IntegrityError`` is the
    driver's exception for a violated constraint (a duplicate SOP Instance UID).
    """

    def __init__(self, conn: Any, begin: str, integrity_error: type[Exception]) -> None:
        self._conn = conn
        self._begin = begin
        self.IntegrityError = integrity_error

    @classmethod
    def sqlite(cls, path: Path) -> HotConnection:
        """SQLite: ``BEGIN IMMEDIATE`` transactions, no WAL fsync per commit (see the
        package docstring); the spool file is the durable record, and start-up re-records
        files without a row."""
        conn = _open_sqlite(path, HOT_WAIT_S)
        conn.isolation_level = None
        _sqlite_pragmas(conn, None)
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={int(HOT_WAIT_S * 1000)}")
        return cls(conn, "BEGIN IMMEDIATE", sqlite3.IntegrityError)

    @classmethod
    def postgresql(cls, url: str) -> HotConnection:
        """PostgreSQL through psycopg; each commit is durable (the server's settings)."""
        import psycopg  # the postgres extra; the engine of a postgresql URL already needs it

        conn = psycopg.connect(libpq_conninfo(url), autocommit=True, options=session_options(url))
        return cls(conn, "BEGIN", psycopg.IntegrityError)

    def execute(self, statement: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; returns the driver's cursor (``fetchone``)."""
        return self._conn.execute(statement, params)

    @property
    def broken(self) -> bool:
        """Whether the connection is lost (a PostgreSQL server restarted or went away): it
        is replaced at its next use."""
        if isinstance(self._conn, sqlite3.Connection):
            return False
        return bool(self._conn.closed or self._conn.broken)

    def begin(self) -> None:
        """Start a transaction."""
        self._conn.execute(self._begin)

    def commit(self) -> None:
        """Commit the transaction."""
        self._conn.execute("COMMIT")

    def rollback(self) -> None:
        """Roll the transaction back, if one is open."""
        if self.in_transaction:
            self._conn.execute("ROLLBACK")

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open."""
        if isinstance(self._conn, sqlite3.Connection):
            return self._conn.in_transaction
        return bool(self._conn.info.transaction_status != 0)  # psycopg: 0 is IDLE

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()


def _open_sqlite(path: Path | None, timeout: float) -> sqlite3.Connection:
    """A connection to the ledger file at ``path``, which must exist (``mode=rw``): where the
    file was deleted under the node, SQLite would otherwise create an empty one there, and
    the node would fail on missing tables or, worse, carry on in a new ledger."""
    assert path is not None
    return sqlite3.connect(
        f"file:{quote(str(path.absolute()))}?mode=rw",
        uri=True,
        timeout=timeout,
        check_same_thread=False,
    )


def _identity(path: Path) -> tuple[int, int]:
    """The file at ``path``: its device and inode."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_S * 1000)}")
    cur.close()
