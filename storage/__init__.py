"""Durable state: the job ledger (SQLAlchemy on SQLite) and the instance spool on disk."""
