"""Schema version 3: several nodes on one ledger (their heartbeats, the owners of jobs and
deliveries, the deliveries' leases).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from segnode.storage.migrations import set_version

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    """Schema version 3."""
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("stopped_at", sa.DateTime(), nullable=True),
    )
    op.add_column("jobs", sa.Column("owner", sa.String(128), nullable=True))
    op.create_index("ix_jobs_owner", "jobs", ["owner"])
    op.add_column("deliveries", sa.Column("owner", sa.String(128), nullable=True))
    op.add_column("deliveries", sa.Column("lease_until", sa.DateTime(), nullable=True))
    set_version(op.get_bind(), 3)
