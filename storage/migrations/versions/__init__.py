"""The ledger's Alembic revisions, one per schema version (``0002`` is version 2)."""
