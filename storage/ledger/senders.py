"""Learnt sender patterns and the completion tracker's hold notes.

Owns :class:`SenderStore`: the stored pattern of each calling AE (:meth:`SenderStore.senders`,
:meth:`SenderStore.save_sender`) and the note of why a release did not complete a series
(:meth:`SenderStore.record_hold`; :meth:`~segnode.storage.ledger.views.Views.held_series` shows it).

Must not touch: instances, jobs or deliveries; it writes only sender rows and ``held`` events.
"""

from __future__ import annotations

from sqlalchemy import select

from segnode.storage.ledger.connection import LedgerBase, utcnow
from segnode.storage.models import Event, Sender, Series


class SenderStore(LedgerBase):
    """Sender patterns and hold notes (a part of :class:`~segnode.storage.ledger.Ledger`)."""

    def senders(self) -> list[tuple[str, int, int, str, float | None]]:
        """Learnt sender patterns: (calling AE, associations, instances, recent, gap in ms)."""
        with self._read() as s:
            return [
                (r.calling_ae, r.associations, r.instances, r.recent, r.gap_ms)
                for r in s.scalars(select(Sender).order_by(Sender.calling_ae))
            ]

    def save_sender(
        self, calling_ae: str, associations: int, instances: int, recent: str, gap_ms: float | None
    ) -> None:
        """Store a sender's learnt pattern."""
        with self._tx() as s:
            row = s.get(Sender, calling_ae[:16])
            if row is None:
                row = Sender(calling_ae=calling_ae[:16])
                s.add(row)
            row.associations, row.instances = associations, instances
            row.recent, row.gap_ms, row.updated_at = recent[-32:], gap_ms, utcnow()

    def record_hold(self, series_instance_uid: str, reason: str) -> None:
        """Note why a release did not complete a series (shown by ``segnode jobs``)."""
        with self._tx() as s:
            series = s.scalar(
                select(Series).where(Series.series_instance_uid == series_instance_uid)
            )
            if series is not None:
                s.add(Event(at=utcnow(), kind="held", series_id=series.id, message=reason[:2048]))
