"""The nodes on a ledger: who is alive, whose running jobs may be taken over.

Owns :class:`NodeStore` and :class:`NodeView`: a node joins the ledger under its name
(:meth:`NodeStore.join`, which on PostgreSQL also takes a session advisory lock for that
name, so that two processes cannot run as one node), writes a heartbeat every
``lease / 4`` (:meth:`NodeStore.heartbeat`), and leaves on a clean stop
(:meth:`NodeStore.leave`). A node whose heartbeat is older than the lease is gone: another
node requeues its running jobs (:meth:`~segnode.storage.ledger.jobs.JobStore.take_over`).

Must not touch: the jobs and deliveries themselves (the jobs and outbox modules decide from
:meth:`NodeStore._gone_clause` and the lease which rows they may take).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, func, or_, select, text, update
from sqlalchemy.orm import Session

from segnode.storage.ledger.connection import (
    HotConnection,
    LedgerBase,
    LedgerInUse,
    libpq_conninfo,
    session_options,
)
from segnode.storage.ledger.states import JobState
from segnode.storage.models import Job, Node


@dataclass(frozen=True)
class NodeView:
    """A node as ``segnode status`` shows it."""

    name: str
    address: str
    pid: int
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    alive: bool
    running_jobs: int


#: The PostgreSQL notification channel for "a job was queued or results were encoded".
CHANNEL = "segnode_work"
log = logging.getLogger("segnode.storage.ledger")


def _lock_key(name: str) -> int:
    """A signed 64-bit advisory-lock key for a node name."""
    return int.from_bytes(
        hashlib.sha256(b"segnode-node:" + name.encode()).digest()[:8], "big", signed=True
    )


class NodeStore(LedgerBase):
    """The nodes and their heartbeats (a part of :class:`~segnode.storage.ledger.Ledger`)."""

    def join(self, name: str, address: str, lease_s: float) -> None:
        """Run as node ``name`` (``AE@host:port`` in ``address``) with a lease of ``lease_s``:
        record it with a fresh heartbeat; jobs and deliveries it claims carry its name.

        Raises
        ------
        LedgerInUse
            On PostgreSQL, if a live process already runs as ``name`` on this ledger.
        """
        if self.dialect == "postgresql" and self._node_lock is None:
            hot = HotConnection.postgresql(self.url)
            got = hot.execute("SELECT pg_try_advisory_lock(%s)", (_lock_key(name),)).fetchone()
            if not got[0]:
                hot.close()
                raise LedgerInUse(
                    f"ledger {self.where}: a node named {name!r} is already running on it; "
                    "give each node its own [ledger] node_name"
                )
            self._node_lock = hot
        self.node_name = name
        self.lease = timedelta(seconds=lease_s)
        with self._tx() as s:
            now = self._clock_value(s)
            row = s.get(Node, name, with_for_update=True)
            if row is None:
                s.add(
                    Node(
                        name=name,
                        address=address[:256],
                        pid=os.getpid(),
                        started_at=now,
                        heartbeat_at=now,
                        stopped_at=None,
                    )
                )
            else:
                row.address, row.pid = address[:256], os.getpid()
                row.started_at = row.heartbeat_at = now
                row.stopped_at = None

    def listen(self, woken: Callable[[], None]) -> None:
        """Call ``woken`` whenever any node queues a job or encodes results (PostgreSQL's
        ``LISTEN``/``NOTIFY`` on :data:`CHANNEL`), so that an idle node starts at once
        instead of at its next poll. A thread with a connection of its own; it reconnects
        after a lost connection. SQLite (one node): nothing to do."""
        if self.dialect != "postgresql" or self._listener is not None:
            return
        self._listening.clear()
        self._listener = threading.Thread(
            target=self._listen, args=(woken,), name="segnode-ledger-listen", daemon=True
        )
        self._listener.start()

    def _listen(self, woken: Callable[[], None]) -> None:
        import psycopg

        while not self._listening.is_set():
            try:
                with psycopg.connect(
                    libpq_conninfo(self.url), autocommit=True, options=session_options(self.url)
                ) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    while not self._listening.is_set():
                        for _ in conn.notifies(timeout=0.5):
                            woken()
            except psycopg.Error as exc:
                log.warning("ledger notifications lost (%s); polling until they are back", exc)
                self._listening.wait(5.0)

    def _notify(self, s: Session) -> None:
        """Tell the other nodes there is work (delivered when ``s`` commits)."""
        if self.dialect == "postgresql":
            s.execute(text(f"NOTIFY {CHANNEL}"))

    def heartbeat(self) -> None:
        """Say this node is alive (every ``lease / 4``)."""
        if self.node_name is None:
            return
        with self._tx() as s:
            s.execute(
                update(Node).where(Node.name == self.node_name).values(heartbeat_at=self.clock())
            )

    def leave(self) -> None:
        """A clean stop: the node's heartbeat ends now, so that others need not wait out
        the lease for what it leaves."""
        if self.node_name is None:
            return
        with self._tx() as s:
            now = self._clock_value(s)
            row = s.get(Node, self.node_name)
            if row is not None:
                row.stopped_at = now
                row.heartbeat_at = now - self.lease

    def _gone_clause(self) -> ColumnElement[bool]:
        """Jobs whose owner is not a live node (no owner, an unknown one, or an expired
        heartbeat)."""
        return or_(Job.owner.is_(None), Job.owner.not_in(self._live_nodes()))

    def nodes(self) -> list[NodeView]:
        """Every node that has run on this ledger, the most recently started first."""
        with self._read() as s:
            alive = Node.stopped_at.is_(None) & (Node.heartbeat_at > self.clock() - self.lease)
            rows = s.execute(select(Node, alive).order_by(Node.started_at.desc())).all()
            running = s.execute(
                select(Job.owner, func.count(Job.id))
                .where(Job.state == JobState.RUNNING)
                .group_by(Job.owner)
            ).all()
            counts = {owner: int(n) for owner, n in running}
            return [
                NodeView(
                    n.name,
                    n.address,
                    n.pid,
                    n.started_at,
                    n.heartbeat_at,
                    n.stopped_at,
                    bool(live),
                    counts.get(n.name, 0),
                )
                for n, live in rows
            ]
