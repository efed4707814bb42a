"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from segnode.storage.migrations import set_version

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}


def upgrade() -> None:
    """Schema version ${up_revision.lstrip("0")}."""
    ${upgrades if upgrades else "pass"}
    set_version(op.get_bind(), ${up_revision.lstrip("0")})
