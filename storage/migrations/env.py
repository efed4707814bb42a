"""Alembic's environment for the ledger: runs on the connection that
:func:`segnode.storage.migrations.upgrade` opened (inside its transaction and lock)."""

from __future__ import annotations

from alembic import context

from segnode.storage.models import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata)
with context.begin_transaction():
    context.run_migrations()
