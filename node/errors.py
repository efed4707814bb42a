"""The node's exception tree."""

import logging


class SegnodeError(Exception):
    """Base of the node's own errors."""


class ConfigError(SegnodeError):
    """The configuration is invalid; the message names the key."""


class JobError(SegnodeError):
    """A job cannot be completed; the message is the reason shown to the admin."""


class ResultError(SegnodeError):
    """A SEG or SR cannot be built or does not reproduce the result; the message says why."""


class NoSegmentsError(ResultError):
    """The label map has no labelled voxel: there is nothing to encode."""


def is_ledger_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the ledger's database cannot be written or reached now (full
    disk, locked by another process, a PostgreSQL server away), as opposed to a bug.

    Steps that run again by themselves (completion, the quiet-period scan, the worker) log
    such a failure as one line: its traceback says nothing more, and repeated every second
    it buries the log.
    """
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from segnode.storage.ledger.connection import LedgerBusy

    if isinstance(exc, sqlite3.OperationalError | OperationalError | LedgerBusy):
        return True
    # psycopg's, raised by the hot-path connection (the postgres extra may be absent).
    return any(
        c.__name__ == "OperationalError" and c.__module__.startswith("psycopg")
        for c in type(exc).__mro__
    )


def log_failure(logger: logging.Logger, message: str, *args: object, exc: BaseException) -> None:
    """Log ``message % args`` for the failure ``exc`` of a step that runs again: one line with
    the cause for a ledger outage (:func:`is_ledger_outage`), else with the traceback."""
    if is_ledger_outage(exc):
        logger.error(f"{message}: the ledger cannot be written now (%s)", *args, exc)
    else:
        logger.error(message, *args, exc_info=exc)
