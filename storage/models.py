"""Ledger tables (SQLAlchemy 2.x declarative mapping).

The ledger is the single source of truth: every received instance, every job and its stage
timestamps, every result object and every delivery attempt is a row here. Nothing about work
in progress is kept only in memory.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, Index, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

#: Bumped with each change of the tables' columns, with an Alembic revision of the same number
#: (:mod:`segnode.storage.migrations`) that upgrades older ledgers (version 2:
#: ``deliveries.sending_at``; version 3: ``nodes``, the owners of jobs and deliveries and the
#: deliveries' leases).
SCHEMA_VERSION = 3


class Base(DeclarativeBase):
    """Declarative base of the ledger."""


class Meta(Base):
    """Key/value facts about the ledger itself (schema version)."""

    __tablename__ = "meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(256))


class Study(Base):
    """A study seen by the node."""

    __tablename__ = "studies"
    id: Mapped[int] = mapped_column(primary_key=True)
    study_instance_uid: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]


class Series(Base):
    """A series and its receive state.

    ``pending_since`` is set while the series has instances that no job has taken yet; job
    creation clears it in the same transaction.
    """

    __tablename__ = "series"
    id: Mapped[int] = mapped_column(primary_key=True)
    series_instance_uid: Mapped[str] = mapped_column(String(64), unique=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("studies.id"))
    modality: Mapped[str] = mapped_column(String(16), default="")
    calling_ae: Mapped[str] = mapped_column(String(16), default="")
    first_received_at: Mapped[datetime]
    last_received_at: Mapped[datetime]
    pending_since: Mapped[datetime | None]
    instance_count: Mapped[int] = mapped_column(default=0)
    ignored_reason: Mapped[str | None] = mapped_column(String(512))


class Instance(Base):
    """One stored (acknowledged) instance and where its bytes are in the spool."""

    __tablename__ = "instances"
    id: Mapped[int] = mapped_column(primary_key=True)
    sop_instance_uid: Mapped[str] = mapped_column(String(64), unique=True)
    sop_class_uid: Mapped[str] = mapped_column(String(64))
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"), index=True)
    transfer_syntax_uid: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(String(1024))
    size: Mapped[int] = mapped_column(BigInteger)
    calling_ae: Mapped[str] = mapped_column(String(16))
    received_at: Mapped[datetime]


class Job(Base):
    """One run of a model over one version of a series.

    Routing may run several models over one series version: one job each (``model_name``),
    each with its own result UIDs. ``destinations`` is the JSON list of destination names
    chosen by the routing rule when the job was created (``AE@host:port``, ``stow:<url>``).

    States: ``queued -> running -> encoded -> sent`` or ``failed``; ``cancelled`` and
    ``superseded`` end a job without results. Each stage has its own timestamp.
    Result UIDs are allocated when the job is created so that a re-encoding after a crash
    produces objects with the same identity.
    """

    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("series_id", "version", "model_name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"), index=True)
    version: Mapped[int]
    state: Mapped[str] = mapped_column(String(16), index=True)
    priority: Mapped[int] = mapped_column(default=0)
    model: Mapped[str] = mapped_column(String(128))
    model_name: Mapped[str] = mapped_column(String(64), default="default")
    rule: Mapped[str] = mapped_column(String(128), default="")
    destinations: Mapped[str] = mapped_column(String(8192), default="[]")
    engine: Mapped[str] = mapped_column(String(32))
    trigger: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(String(2048))
    attempts: Mapped[int] = mapped_column(default=0)
    instance_count: Mapped[int] = mapped_column(default=0)
    first_instance_at: Mapped[datetime | None]
    last_instance_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    volume_at: Mapped[datetime | None]
    inference_at: Mapped[datetime | None]
    encoded_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    seg_series_uid: Mapped[str] = mapped_column(String(64))
    seg_sop_uid: Mapped[str] = mapped_column(String(64), unique=True)
    sr_series_uid: Mapped[str] = mapped_column(String(64))
    sr_sop_uid: Mapped[str] = mapped_column(String(64), unique=True)
    #: The node running it (``running``), or that ran it last; its lease is the node's
    #: heartbeat (:class:`Node`).
    owner: Mapped[str | None] = mapped_column(String(128), index=True)


class Result(Base):
    """An encoded result object (SEG or SR) on disk, ready to send."""

    __tablename__ = "results"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(8))
    sop_class_uid: Mapped[str] = mapped_column(String(64))
    sop_instance_uid: Mapped[str] = mapped_column(String(64), unique=True)
    series_instance_uid: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(String(1024))
    order: Mapped[int] = mapped_column(default=0)


class Delivery(Base):
    """One result object to one destination: the outbox row.

    ``sending_at`` is when the outbox started the latest attempt (the send stage),
    ``sent_at`` when the destination acknowledged it; their difference is the send time.
    """

    __tablename__ = "deliveries"
    __table_args__ = (
        UniqueConstraint("result_id", "destination"),
        Index("ix_deliveries_due", "status", "next_attempt_at"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    result_id: Mapped[int] = mapped_column(ForeignKey("results.id"), index=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    destination: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(16))  # pending | sent | failed
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime]
    last_status: Mapped[str | None] = mapped_column(String(16))
    last_error: Mapped[str | None] = mapped_column(String(1024))
    created_at: Mapped[datetime]
    sending_at: Mapped[datetime | None]
    sent_at: Mapped[datetime | None]
    #: The node that claimed the latest attempt, and until when no other node may take it.
    owner: Mapped[str | None] = mapped_column(String(128))
    lease_until: Mapped[datetime | None]


class Node(Base):
    """A ``segnode serve`` process on this ledger, and its heartbeat.

    A node's running jobs are its own while its heartbeat is younger than the lease
    (``[ledger] lease_s``); after that any node requeues them. ``stopped_at`` is set by a
    clean stop (its heartbeat is then expired at once).
    """

    __tablename__ = "nodes"
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    address: Mapped[str] = mapped_column(String(256), default="")
    pid: Mapped[int] = mapped_column(default=0)
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]
    stopped_at: Mapped[datetime | None]


class Event(Base):
    """Append-only log of what happened, for ``segnode jobs`` and audits (no patient data)."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(index=True)
    kind: Mapped[str] = mapped_column(String(32))
    job_id: Mapped[int | None] = mapped_column(index=True)
    series_id: Mapped[int | None]
    message: Mapped[str] = mapped_column(String(2048))


class SpoolPurge(Base):
    """Retention: when a delivered series' spooled instances (and sent results) were deleted.

    A table of its own, so that ledgers made before it gain it without a migration
    (``create_all`` adds missing tables).
    """

    __tablename__ = "spool_purges"
    id: Mapped[int] = mapped_column(primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"), unique=True)
    purged_at: Mapped[datetime]
    files: Mapped[int] = mapped_column(default=0)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class Sender(Base):
    """A calling AE title's learnt association pattern (see :mod:`segnode.node.ingest.senders`)."""

    __tablename__ = "senders"
    calling_ae: Mapped[str] = mapped_column(String(16), primary_key=True)
    associations: Mapped[int] = mapped_column(default=0)
    instances: Mapped[int] = mapped_column(default=0)
    recent: Mapped[str] = mapped_column(String(32), default="")
    gap_ms: Mapped[float | None]
    updated_at: Mapped[datetime]
