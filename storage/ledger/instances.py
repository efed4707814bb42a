"""Received instances and their series: the SCP's per-instance hot path.

Owns :class:`InstanceRecord` and :class:`InstanceStore`: recording an instance (plain SQL on
the hot connection, the first instance of a series through the ORM), duplicate and loop-guard
lookups, forgetting unacknowledged rows, start-up reconciliation with the spool
(:meth:`InstanceStore.drop_unstored_instances`, :meth:`InstanceStore.missing_instances`),
ignored instances, the pending series, a series' spool paths and its stored totals.

Must not touch: jobs, results or deliveries (it reads jobs and results only for the loop
guard; the jobs module turns pending instances into jobs); locking and durability settings
are the connection module's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import Connection, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from segnode.storage.ledger.connection import HOT_WAIT_S, SQLITE_BUSY_S, LedgerBase, utcnow
from segnode.storage.models import Event, Instance, Job, Result, Series, Study


@dataclass(frozen=True)
class InstanceRecord:
    """What the SCP learned about an instance from its header."""

    sop_instance_uid: str
    sop_class_uid: str
    series_instance_uid: str
    study_instance_uid: str
    transfer_syntax_uid: str
    modality: str
    calling_ae: str


class InstanceStore(LedgerBase):
    """Instances and series as the SCP receives them (a part of
    :class:`~segnode.storage.ledger.Ledger`)."""

    def has_instance(self, sop_instance_uid: str) -> bool:
        """Whether an instance with this SOP Instance UID is already stored.

        Asked for every received instance: one indexed lookup on the hot-path connection.
        """
        with self._hot_lock:
            hot = self._hot_connection()
            row = hot.execute(self._sql(_HAS_INSTANCE), (sop_instance_uid,)).fetchone()
            return row is not None

    def is_own_result(self, sop_instance_uid: str, series_instance_uid: str) -> bool:
        """Whether the object is one this node produced (loop guard)."""
        with self._read() as s:
            hit = s.scalar(
                select(Result.id).where(
                    (Result.sop_instance_uid == sop_instance_uid)
                    | (Result.series_instance_uid == series_instance_uid)
                )
            )
            if hit is not None:
                return True
            hit = s.scalar(
                select(Job.id).where(
                    (Job.seg_series_uid == series_instance_uid)
                    | (Job.sr_series_uid == series_instance_uid)
                )
            )
            return hit is not None

    def _series(self, s: Session, rec: InstanceRecord, now: datetime) -> Series:
        series = s.scalar(
            select(Series).where(Series.series_instance_uid == rec.series_instance_uid)
        )
        if series is None:
            study = s.scalar(
                select(Study).where(Study.study_instance_uid == rec.study_instance_uid)
            )
            if study is None:
                study = Study(study_instance_uid=rec.study_instance_uid, created_at=now)
                s.add(study)
                s.flush()
            series = Series(
                series_instance_uid=rec.series_instance_uid,
                study_id=study.id,
                modality=rec.modality[:16],
                calling_ae=rec.calling_ae[:16],
                first_received_at=now,
                last_received_at=now,
                pending_since=None,
                instance_count=0,
            )
            s.add(series)
            s.flush()
        return series

    def record_instance(
        self, rec: InstanceRecord, path: Path, size: int, *, _retry: bool = True
    ) -> bool:
        """Record a stored instance; return False if it was already there (duplicate).

        The SCP's hot path: one short transaction of three plain SQL statements on the
        hot-path connection: find the series, insert the instance (its unique SOP Instance UID
        refuses a duplicate), update the series' counters. The first instance of a series
        creates the study and series rows through the ORM instead. Committed before the caller
        answers success, without a WAL fsync (``synchronous=NORMAL``): the instance's spool
        file, fsynced before the answer, is what survives a power cut, and start-up records
        again any file whose row was lost (:meth:`missing_instances`).
        """
        now = utcnow()
        stamp = self._stamp(now)
        values = (
            rec.sop_instance_uid,
            rec.sop_class_uid,
            0,
            rec.transfer_syntax_uid,
            str(path),
            size,
            rec.calling_ae[:16],
            stamp,
        )
        if self.dialect == "postgresql":
            with self._hot_lock:
                # One statement, one round trip, its own transaction (autocommit): a row back
                # means stored; none means a duplicate or the series' first instance.
                row = (
                    self._hot_connection()
                    .execute(
                        _RECORD_PG,
                        (rec.series_instance_uid, *values[:2], *values[3:], stamp, stamp),
                    )
                    .fetchone()
                )
            if row is not None:
                return True
            if self.has_instance(rec.sop_instance_uid):
                return False
        with self._hot_write():
            # SQLite: the same three statements in one BEGIN IMMEDIATE transaction. (On
            # PostgreSQL the statement above found no series: its first instance.)
            if self.dialect == "sqlite":
                with self._hot_lock:
                    hot = self._hot_connection()
                    hot.begin()
                    try:
                        row = hot.execute(
                            self._sql(_SERIES_ID), (rec.series_instance_uid,)
                        ).fetchone()
                        if row is not None:
                            hot.execute(
                                self._sql(_INSERT_INSTANCE), (*values[:2], row[0], *values[3:])
                            )
                            hot.execute(self._sql(_SERIES_RECEIVED), (stamp, stamp, row[0]))
                            hot.commit()
                            return True
                        hot.rollback()
                    except hot.IntegrityError:
                        hot.rollback()
                        return False
                    except BaseException:
                        hot.rollback()
                        raise
            # The series' first instance: create the study and series rows (on SQLite
            # waiting for the database as briefly as the hot path does).
            try:
                with self.engine.begin() as sa, _busy_timeout(sa, HOT_WAIT_S):
                    with Session(bind=sa) as s:
                        series_id = self._series(s, rec, now).id
                    sa.exec_driver_sql(
                        self._sql(_INSERT_INSTANCE), (*values[:2], series_id, *values[3:])
                    )
                    sa.exec_driver_sql(self._sql(_SERIES_RECEIVED), (stamp, stamp, series_id))
                    return True
            except IntegrityError:
                # A duplicate SOP Instance UID, or the study/series row created meanwhile by
                # another writer: only the first is a duplicate; the second is retried.
                if self.has_instance(rec.sop_instance_uid) or not _retry:
                    return False
        return self.record_instance(rec, path, size, _retry=False)

    def instance_file(self, sop_instance_uid: str) -> tuple[Path, int] | None:
        """Where an instance's bytes were recorded, and their size (None: no such row)."""
        with self._hot_lock:
            row = (
                self._hot_connection()
                .execute(self._sql(_INSTANCE_FILE), (sop_instance_uid,))
                .fetchone()
            )
        return None if row is None else (Path(row[0]), int(row[1]))

    def instance_purged(self, sop_instance_uid: str) -> bool:
        """Whether retention deleted the spool files of the instance's series."""
        with self.engine.connect() as conn:
            row = conn.exec_driver_sql(self._sql(_INSTANCE_PURGED), (sop_instance_uid,)).first()
        return row is not None

    def move_instance(self, sop_instance_uid: str, path: Path, size: int) -> bool:
        """Point an instance's row at another copy of its bytes (a node storing an instance
        whose recorded file another node did not finish: it died, or it is still writing);
        False when there is no such row."""
        with self._write_lock, self.engine.begin() as conn:
            done = conn.exec_driver_sql(
                self._sql(_MOVE_INSTANCE), (str(path), size, sop_instance_uid)
            )
            return bool(done.rowcount)

    def forget_instance(self, sop_instance_uid: str) -> None:
        """Remove an instance row that was never acknowledged (its file did not persist)."""
        with self._write_lock, self.engine.begin() as conn:
            row = conn.exec_driver_sql(self._sql(_INSTANCE_SERIES), (sop_instance_uid,)).first()
            if row is not None:
                conn.exec_driver_sql(self._sql(_DELETE_INSTANCE), (row[0],))
                conn.exec_driver_sql(self._sql(_SERIES_FORGOT), (row[1],))

    def drop_unstored_instances(self, spool: Path | None = None) -> int:
        """At start-up: remove rows of series still receiving whose spool file is missing.

        ``spool``: only rows of files under this folder (this node's spool). On a shared
        ledger another node's rows are its own: it may be writing their files right now.

        The C-STORE path commits the ledger row while the spool folder's fsync runs; a crash
        between the two can leave a row whose rename did not persist. Such an instance was
        never acknowledged, so the row goes (and the sender's retry stores it again).

        A file whose size differs from the row's is unacknowledged too: a recycled staging
        file is cut to the instance's size and renamed, then both are synced before the
        answer; a file system that kept the rename but not the cut leaves the old length.
        Such a file goes with its row.
        """
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql(_PENDING_INSTANCES).all()
        missing = []
        for sop_uid, path, size in rows:
            if spool is not None and not Path(path).is_relative_to(spool):
                continue
            try:
                actual = os.stat(path).st_size
            except OSError:
                missing.append(sop_uid)
                continue
            if size is not None and actual != size:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                missing.append(sop_uid)
        for sop_uid in missing:
            self.forget_instance(sop_uid)
        return len(missing)

    def missing_instances(self, paths: Sequence[Path]) -> list[Path]:
        """The spool files among ``paths`` that have no instance row.

        A power cut can lose the last instance rows (committed with ``synchronous=NORMAL``)
        while their fsynced files remain: start-up records those files again.
        """
        # Spool files are named <SOP Instance UID>.dcm: look them up by that unique index,
        # a chunk at a time (a ledger may hold far more rows than the spool has files).
        known: set[str] = set()
        names = [p.name.removesuffix(".dcm") for p in paths]
        with self.engine.connect() as conn:
            for i in range(0, len(names), 500):
                chunk = names[i : i + 500]
                marks = ", ".join("?" * len(chunk))
                known_in = (
                    f"SELECT sop_instance_uid FROM instances WHERE sop_instance_uid IN ({marks})"
                )
                rows = conn.exec_driver_sql(
                    self._sql(known_in),
                    tuple(chunk),
                )
                known.update(r[0] for r in rows)
        return [p for p, name in zip(paths, names, strict=True) if name not in known]

    def record_ignored(self, rec: InstanceRecord, reason: str) -> None:
        """Record that an instance was accepted but not kept, and why (series level)."""
        now = utcnow()
        with self._tx() as s:
            series = self._series(s, rec, now)
            series.last_received_at = now
            if series.instance_count == 0:
                series.ignored_reason = reason[:512]
            s.add(Event(at=now, kind="ignored", series_id=series.id, message=reason[:2048]))

    def pending_series(self, quiet_before: datetime | None = None) -> list[str]:
        """Series UIDs with instances not yet taken by a job.

        Parameters
        ----------
        quiet_before
            If given, only series whose last instance arrived before this time.
        """
        with self._read() as s:
            q = select(Series.series_instance_uid).where(Series.pending_since.is_not(None))
            if quiet_before is not None:
                q = q.where(Series.last_received_at < quiet_before)
            return list(s.scalars(q))

    def instance_paths(self, series_instance_uid: str) -> list[Path]:
        """Spool paths of every instance of a series."""
        with self._read() as s:
            rows = s.scalars(
                select(Instance.path)
                .join(Series, Series.id == Instance.series_id)
                .where(Series.series_instance_uid == series_instance_uid)
                .order_by(Instance.id)
            )
            return [Path(p) for p in rows]

    def series_totals(self, series_instance_uid: str) -> tuple[int, int]:
        """``(instances, bytes)`` stored for a series (0, 0 if unknown)."""
        with self._read() as s:
            n, size = s.execute(
                select(func.count(Instance.id), func.coalesce(func.sum(Instance.size), 0))
                .join(Series, Series.id == Instance.series_id)
                .where(Series.series_instance_uid == series_instance_uid)
            ).one()
            return int(n), int(size)


# The SCP's per-instance statements (see Ledger.record_instance / has_instance).
@contextlib.contextmanager
def _busy_timeout(conn: Connection, seconds: float) -> Iterator[None]:
    """On SQLite, wait at most ``seconds`` for another writer within the block (the pooled
    connection's usual :data:`SQLITE_BUSY_S` after it)."""
    if conn.dialect.name != "sqlite":
        yield
        return
    conn.exec_driver_sql(f"PRAGMA busy_timeout={int(seconds * 1000)}")
    try:
        yield
    finally:
        conn.exec_driver_sql(f"PRAGMA busy_timeout={int(SQLITE_BUSY_S * 1000)}")


_HAS_INSTANCE = "SELECT 1 FROM instances WHERE sop_instance_uid = ?"
_SERIES_ID = "SELECT id FROM series WHERE series_instance_uid = ?"
_INSTANCE_SERIES = "SELECT id, series_id FROM instances WHERE sop_instance_uid = ?"
_DELETE_INSTANCE = "DELETE FROM instances WHERE id = ?"
_INSTANCE_FILE = "SELECT path, size FROM instances WHERE sop_instance_uid = ?"
_MOVE_INSTANCE = "UPDATE instances SET path = ?, size = ? WHERE sop_instance_uid = ?"
_INSTANCE_PURGED = (
    "SELECT 1 FROM spool_purges p JOIN instances i ON i.series_id = p.series_id "
    "WHERE i.sop_instance_uid = ?"
)
_SERIES_FORGOT = (
    "UPDATE series SET instance_count = "
    "CASE WHEN instance_count > 0 THEN instance_count - 1 ELSE 0 END WHERE id = ?"
)
_PENDING_INSTANCES = (
    "SELECT i.sop_instance_uid, i.path, i.size FROM instances i "
    "JOIN series s ON s.id = i.series_id WHERE s.pending_since IS NOT NULL"
)
_INSERT_INSTANCE = (
    "INSERT INTO instances (sop_instance_uid, sop_class_uid, series_id, transfer_syntax_uid, "
    "path, size, calling_ae, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
# PostgreSQL: find the series, insert the instance unless its SOP Instance UID is there, count
# it in the series, in one statement (params: the series UID, the instance's values but its
# series id, then the received stamp twice).
_RECORD_PG = (
    "WITH s AS (SELECT id FROM series WHERE series_instance_uid = %s), "
    "i AS (INSERT INTO instances (sop_instance_uid, sop_class_uid, series_id, "
    "transfer_syntax_uid, path, size, calling_ae, received_at) "
    "SELECT %s, %s, s.id, %s, %s, %s, %s, %s FROM s "
    "ON CONFLICT (sop_instance_uid) DO NOTHING RETURNING series_id) "
    "UPDATE series SET instance_count = instance_count + 1, last_received_at = %s, "
    "ignored_reason = NULL, pending_since = COALESCE(pending_since, %s) "
    "WHERE id = (SELECT series_id FROM i) RETURNING id"
)
_SERIES_RECEIVED = (
    "UPDATE series SET instance_count = instance_count + 1, last_received_at = ?, "
    "ignored_reason = NULL, pending_since = COALESCE(pending_since, ?) WHERE id = ?"
)
