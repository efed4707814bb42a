"""What the node learns about each sender's pattern, per calling AE title.

Many senders open one association per instance (a PACS forwarding with Orthanc's
``OnStoredInstance``, scanners that send each image as it is reconstructed, ``storescu`` called
once per file); others send a whole series per association. A release completes a series only
when the association carried all of it, so the node learns, per calling AE title, whether its
associations *continue* a series that an earlier association of the same AE delivered moments
before, and how long the gaps between such associations are. The patterns live in the ledger
(``senders`` table) and survive restarts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from segnode.node.errors import log_failure

#: Associations remembered per sender (a rolling window of "continued" / "new series").
WINDOW = 16
#: Continuations among the last ``WINDOW`` associations that make a sender a splitter.
SPLITS_IN_WINDOW = 2
#: An association continues a series when the series' previous association from the same AE
#: ended at most this long before it opened.
CONTINUE_WINDOW_S = 30.0
#: The wait after a split sender's last association: this many times its usual gap, at least
#: ``MIN_WAIT_S`` and at most the quiet period (which completes the series anyway). A fixed
#: upper bound (3 s) completed a series after every instance of a sender slower than 0.75 s
#: per association, each time with part of it.
GAP_FACTOR = 4.0
MIN_WAIT_S = 0.5
#: The wait for a sender not seen splitting a series yet whose association was too short to
#: tell (fewer than ``FEW_INSTANCES`` instances of the series).
DEFAULT_WAIT_S = 1.0
#: An association that delivered fewer instances of a series than this is not taken as the
#: whole series on its own: even a sender never seen before gets a short wait.
FEW_INSTANCES = 3


@dataclass(frozen=True)
class SenderPattern:
    """A calling AE title's association pattern."""

    calling_ae: str
    #: Associations that delivered instances, in all.
    associations: int = 0
    #: Instances those associations delivered, in all.
    instances: int = 0
    #: The last ``WINDOW`` associations, oldest first: "c" continued a series, "n" did not.
    recent: str = ""
    #: Smoothed gap (s) between a series' associations when this sender splits one.
    gap_s: float | None = None

    @property
    def splits_series(self) -> bool:
        """Whether the sender splits series over associations: at least
        ``SPLITS_IN_WINDOW`` of its recent associations continued a series. One alone is a
        late instance, which a whole-series sender sends now and then: its next series
        must not wait for it."""
        return self.recent.count("c") >= SPLITS_IN_WINDOW

    @property
    def per_association(self) -> float:
        """Mean instances per association."""
        return self.instances / self.associations if self.associations else 0.0

    def wait_s(self, most: float = CONTINUE_WINDOW_S) -> float:
        """How long to wait after an association that may not have ended the series: at
        most ``most`` seconds (the quiet period)."""
        if self.gap_s is None:
            return min(most, DEFAULT_WAIT_S)
        return min(most, max(MIN_WAIT_S, GAP_FACTOR * self.gap_s))

    def describe(self) -> str:
        """One line for ``segnode status`` and the hold reasons."""
        if not self.associations:
            return "not seen yet"
        n = self.per_association
        if self.splits_series:
            each = "one instance" if n < 1.5 else f"about {n:.0f} instances"
            gap = "" if self.gap_s is None else f", {self.gap_s * 1000:.0f} ms apart"
            return f"sends {each} per association{gap}"
        return f"sends whole series per association (about {n:.0f} instances)"

    def after(self, instances: int, continued: bool, gap_s: float | None) -> SenderPattern:
        """The pattern once one more association (``instances`` delivered) has ended."""
        gap = self.gap_s
        if continued and gap_s is not None:
            gap = gap_s if gap is None else 0.7 * gap + 0.3 * gap_s
        return replace(
            self,
            associations=self.associations + 1,
            instances=self.instances + instances,
            recent=(self.recent + ("c" if continued else "n"))[-WINDOW:],
            gap_s=gap,
        )


class SenderStore(Protocol):
    """Where patterns are kept (:class:`segnode.storage.ledger.Ledger`)."""

    def senders(self) -> list[tuple[str, int, int, str, float | None]]:
        """Every kept pattern: AE title, associations, instances, recent, gap (ms)."""

    def save_sender(
        self, calling_ae: str, associations: int, instances: int, recent: str, gap_ms: float | None
    ) -> None:
        """Keep (insert or replace) the pattern of ``calling_ae``."""


def load_patterns(store: SenderStore) -> list[SenderPattern]:
    """The patterns kept in ``store`` (gaps stored in milliseconds)."""
    return [
        SenderPattern(ae, n, k, recent, None if gap_ms is None else gap_ms / 1000)
        for ae, n, k, recent, gap_ms in store.senders()
    ]


def save_pattern(store: SenderStore, p: SenderPattern) -> None:
    """Keep ``p`` in ``store``."""
    gap_ms = None if p.gap_s is None else p.gap_s * 1000
    store.save_sender(p.calling_ae, p.associations, p.instances, p.recent, gap_ms)


class SenderBook:
    """The patterns of every calling AE title, persisted through ``save``.

    Parameters
    ----------
    patterns
        The patterns known at start (from the ledger).
    save
        Called with a pattern after each change (None keeps them in memory only).
    """

    def __init__(
        self,
        patterns: Iterable[SenderPattern] = (),
        save: Callable[[SenderPattern], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._patterns = {p.calling_ae: p for p in patterns}
        self._save = save

    def get(self, calling_ae: str) -> SenderPattern:
        """The pattern learnt for ``calling_ae`` (an empty one for a sender not seen yet)."""
        with self._lock:
            return self._patterns.get(calling_ae) or SenderPattern(calling_ae)

    def all(self) -> list[SenderPattern]:
        """Every pattern, by AE title."""
        with self._lock:
            return sorted(self._patterns.values(), key=lambda p: p.calling_ae)

    def learn(
        self, calling_ae: str, instances: int, continued: bool, gap_s: float | None
    ) -> SenderPattern:
        """Record one ended association of ``calling_ae``; return the new pattern. It is
        stored by :meth:`persist` (after the completion it decides, which must not wait for
        a ledger write)."""
        with self._lock:
            old = self._patterns.get(calling_ae) or SenderPattern(calling_ae)
            new = self._patterns[calling_ae] = old.after(instances, continued, gap_s)
        return new

    def persist(self, calling_ae: str) -> None:
        """Store ``calling_ae``'s pattern (no error escapes: it is relearnt if lost)."""
        if self._save is None:
            return
        with self._lock:
            pattern = self._patterns.get(calling_ae)
        if pattern is not None:
            try:
                self._save(pattern)
            except Exception as exc:
                log_failure(
                    logging.getLogger(__name__), "storing the sender pattern failed", exc=exc
                )
