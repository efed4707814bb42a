"""Series completion: deciding that a series is ready to become a job.

Signals, in order of speed:

1. **Association release.** When an association that delivered instances of a series is
   released normally and no other open association has delivered instances of the same
   series, the series is complete.
2. **Quiet period** (fallback). A series with instances not yet taken by a job, no open
   association touching it, and nothing received for ``quiet_period_s`` seconds is complete.
   This also covers aborted associations and series left pending by a restart.

The tracker holds only which open associations touched which series; everything durable
(instances, pending flags, jobs) is in the ledger, so losing this state in a crash loses
nothing: the quiet-period rule picks the series up after restart.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable

log = logging.getLogger(__name__)

OnComplete = Callable[[str, str], None]


class CompletionTracker:
    """Which open associations touched which series.

    Parameters
    ----------
    on_complete
        Called as ``on_complete(series_uid, trigger)`` outside the tracker's lock.
    complete_on_release
        Whether a normal release completes the series (config ``series.complete_on_release``).
    """

    def __init__(self, on_complete: OnComplete, *, complete_on_release: bool = True) -> None:
        self._on_complete = on_complete
        self._release = complete_on_release
        self._lock = threading.Lock()
        self._by_assoc: dict[int, set[str]] = defaultdict(set)
        self._open: set[int] = set()

    def opened(self, assoc_id: int) -> None:
        """An association was accepted."""
        with self._lock:
            self._open.add(assoc_id)

    def touched(self, assoc_id: int, series_uid: str) -> None:
        """An association delivered an instance of ``series_uid``."""
        with self._lock:
            self._by_assoc[assoc_id].add(series_uid)

    def busy(self, series_uid: str) -> bool:
        """Whether an open association has delivered instances of ``series_uid``."""
        with self._lock:
            return any(series_uid in s for a, s in self._by_assoc.items() if a in self._open)

    def closed(self, assoc_id: int, *, released: bool) -> list[str]:
        """An association ended; return (and report) the series it completed.

        Parameters
        ----------
        released
            True for a normal A-RELEASE, False for an abort or a dropped connection; only a
            release completes series (an aborted transfer waits for the quiet period).
        """
        with self._lock:
            self._open.discard(assoc_id)
            touched = self._by_assoc.pop(assoc_id, set())
            if not (released and self._release):
                return []
            still_busy = set().union(*self._by_assoc.values()) if self._by_assoc else set()
            done = sorted(touched - still_busy)
        for uid in done:
            try:
                self._on_complete(uid, "association-release")
            except Exception:  # a job-creation failure must not kill the association thread
                log.exception("completing series failed")
        return done
