"""Schema version 2: when the outbox started sending each delivery (the send stage).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from segnode.storage.migrations import set_version

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    """Schema version 2."""
    op.add_column("deliveries", sa.Column("sending_at", sa.DateTime(), nullable=True))
    set_version(op.get_bind(), 2)
