"""The job ledger: every state change of the node is one short transaction, on SQLite (the
embedded default, one node) or PostgreSQL (several nodes; ``[ledger] url``).

SQLite runs in WAL mode with ``synchronous=FULL`` so that a committed row survives power loss,
with one exception: the SCP's per-instance rows (:meth:`Ledger.record_instance`) are committed
with ``synchronous=NORMAL`` - they survive a crash of the process, and the next ``FULL`` commit
of any other transaction (a job, an event) makes them durable on disk too. The spool file of an
acknowledged instance is always fsynced, so a power cut that loses the tail of those rows loses
nothing acknowledged: :meth:`Ledger.missing_instances` lists spool files without a row and the
node records them again at start-up (``Node.start``). Writers are serialised with a
process-wide lock (SQLite allows one writer at a time anyway) so that concurrent associations
never see ``database is locked``.

The package is split by concern; each module says what it owns and what it must not touch:

* :mod:`segnode.storage.ledger.states`: job and delivery states, their allowed moves (``move``).
* :mod:`segnode.storage.ledger.connection`: the engine, sessions, pragmas, the hot sqlite3
  connection and its lock, ``utcnow``.
* :mod:`segnode.storage.ledger.instances`: recording received instances (the SCP's hot path).
* :mod:`segnode.storage.ledger.senders`: learnt sender patterns and hold notes.
* :mod:`segnode.storage.ledger.nodes`: the nodes on a shared ledger and their heartbeats.
* :mod:`segnode.storage.ledger.jobs`: creating, claiming, finishing, retrying and cancelling
  jobs; taking over those of a node whose lease expired.
* :mod:`segnode.storage.ledger.outbox`: deliveries: due, attempted, sent, retried, given up.
* :mod:`segnode.storage.ledger.views`: read-only views (``JobView``, counts, listings).
* :mod:`segnode.storage.ledger.retention`: which series' files may go, and the record of it.

:class:`Ledger` is the one class callers use: it is composed of one part per module, each
method keeping its name and behaviour. Import from here, not from the modules.
"""

from __future__ import annotations

from segnode.storage.ledger.connection import LedgerBase, LedgerInUse, utcnow
from segnode.storage.ledger.instances import InstanceRecord, InstanceStore
from segnode.storage.ledger.jobs import MISSING_FILES, JobStore, NewJob
from segnode.storage.ledger.nodes import NodeStore, NodeView
from segnode.storage.ledger.outbox import DueDelivery, Outbox
from segnode.storage.ledger.retention import PurgeCandidate, Retention
from segnode.storage.ledger.senders import SenderStore
from segnode.storage.ledger.states import (
    ACTIVE_STATES,
    DELIVERY_MOVES,
    FINAL_STATES,
    TRANSITIONS,
    DeliveryStatus,
    JobState,
    TransitionError,
    move,
    move_delivery,
)
from segnode.storage.ledger.views import JobView, SeriesSummary, Views

__all__ = [
    "ACTIVE_STATES",
    "DELIVERY_MOVES",
    "FINAL_STATES",
    "MISSING_FILES",
    "TRANSITIONS",
    "DeliveryStatus",
    "DueDelivery",
    "InstanceRecord",
    "JobState",
    "JobView",
    "Ledger",
    "LedgerInUse",
    "NewJob",
    "NodeView",
    "PurgeCandidate",
    "SeriesSummary",
    "TransitionError",
    "move",
    "move_delivery",
    "utcnow",
]


class Ledger(InstanceStore, SenderStore, JobStore, Outbox, Views, NodeStore, Retention, LedgerBase):
    """The node's durable state, on one SQLite file.

    Parameters
    ----------
    path
        The database file; its folder is created with mode 0700.
    """
