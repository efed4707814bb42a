"""Schema version 1: the ledger's tables as segnode 0.1 made them.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

from segnode.storage.migrations import set_version

revision = "0001"
down_revision = None


def _id() -> sa.Column[Any]:
    return sa.Column("id", sa.Integer(), primary_key=True)


def _uid(name: str, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.String(64), nullable=nullable)


def _at(name: str, nullable: bool = True) -> sa.Column[Any]:
    return sa.Column(name, sa.DateTime(), nullable=nullable)


def _int(name: str) -> sa.Column[Any]:
    return sa.Column(name, sa.Integer(), nullable=False)


def _str(name: str, length: int, nullable: bool = False) -> sa.Column[Any]:
    return sa.Column(name, sa.String(length), nullable=nullable)


def _ref(name: str, target: str) -> sa.Column[Any]:
    """A required foreign key ``name`` to ``target`` (``table.id``)."""
    return sa.Column(name, sa.Integer(), sa.ForeignKey(target), nullable=False)


def _index(table: str, *columns: str) -> None:
    """One ``ix_<table>_<column>`` index on each of ``columns``."""
    for column in columns:
        op.create_index(f"ix_{table}_{column}", table, [column])


def upgrade() -> None:
    """Schema version 1."""
    op.create_table("meta", sa.Column("key", sa.String(64), primary_key=True), _str("value", 256))
    op.create_table(
        "events",
        _id(),
        _at("at", False),
        _str("kind", 32),
        sa.Column("job_id", sa.Integer()),
        sa.Column("series_id", sa.Integer()),
        _str("message", 2048),
    )
    _index("events", "at", "job_id")
    op.create_table(
        "senders",
        sa.Column("calling_ae", sa.String(16), primary_key=True),
        _int("associations"),
        _int("instances"),
        _str("recent", 32),
        sa.Column("gap_ms", sa.Double()),
        _at("updated_at", False),
    )
    op.create_table(
        "studies",
        _id(),
        _uid("study_instance_uid"),
        _at("created_at", False),
        sa.UniqueConstraint("study_instance_uid"),
    )
    op.create_table(
        "series",
        _id(),
        _uid("series_instance_uid"),
        _ref("study_id", "studies.id"),
        _str("modality", 16),
        _str("calling_ae", 16),
        _at("first_received_at", False),
        _at("last_received_at", False),
        _at("pending_since"),
        _int("instance_count"),
        _str("ignored_reason", 512, nullable=True),
        sa.UniqueConstraint("series_instance_uid"),
    )
    op.create_table(
        "instances",
        _id(),
        _uid("sop_instance_uid"),
        _uid("sop_class_uid"),
        _ref("series_id", "series.id"),
        _uid("transfer_syntax_uid"),
        _str("path", 1024),
        sa.Column("size", sa.BigInteger(), nullable=False),
        _str("calling_ae", 16),
        _at("received_at", False),
        sa.UniqueConstraint("sop_instance_uid"),
    )
    _index("instances", "series_id")
    op.create_table(
        "jobs",
        _id(),
        _ref("series_id", "series.id"),
        _int("version"),
        _str("state", 16),
        _int("priority"),
        _str("model", 128),
        _str("model_name", 64),
        _str("rule", 128),
        _str("destinations", 8192),
        _str("engine", 32),
        _str("trigger", 32),
        _str("reason", 2048, nullable=True),
        _int("attempts"),
        _int("instance_count"),
        *(_at(n) for n in ("first_instance_at", "last_instance_at")),
        _at("created_at", False),
        *(_at(n) for n in ("started_at", "volume_at", "inference_at", "encoded_at")),
        _at("finished_at"),
        *(_uid(n) for n in ("seg_series_uid", "seg_sop_uid", "sr_series_uid", "sr_sop_uid")),
        sa.UniqueConstraint("seg_sop_uid"),
        sa.UniqueConstraint("series_id", "version", "model_name"),
        sa.UniqueConstraint("sr_sop_uid"),
    )
    _index("jobs", "series_id", "state")
    op.create_table(
        "spool_purges",
        _id(),
        _ref("series_id", "series.id"),
        _at("purged_at", False),
        _int("files"),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("series_id"),
    )
    op.create_table(
        "results",
        _id(),
        _ref("job_id", "jobs.id"),
        _str("kind", 8),
        _uid("sop_class_uid"),
        _uid("sop_instance_uid"),
        _uid("series_instance_uid"),
        _str("path", 1024),
        _int("order"),
        sa.UniqueConstraint("sop_instance_uid"),
    )
    _index("results", "job_id")
    op.create_table(
        "deliveries",
        _id(),
        _ref("result_id", "results.id"),
        _ref("job_id", "jobs.id"),
        _str("destination", 512),
        _str("status", 16),
        _int("attempts"),
        _at("next_attempt_at", False),
        _str("last_status", 16, nullable=True),
        _str("last_error", 1024, nullable=True),
        _at("created_at", False),
        _at("sent_at"),
        sa.UniqueConstraint("result_id", "destination"),
    )
    op.create_index("ix_deliveries_due", "deliveries", ["status", "next_attempt_at"])
    _index("deliveries", "job_id", "result_id")
    set_version(op.get_bind(), 1)
