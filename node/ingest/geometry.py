"""What the headers of a series say about its extent: the slice stack's geometry.

:class:`SeriesGeometry` records each decoded slice's position, orientation, Images in
Acquisition (0020,1002) and Instance Number, and tells when the stack is complete (uniformly
spaced along the normal, no gap, as many slices as announced) with the tolerances of
:mod:`segnode.node.ingest.volume`, so that a stack called complete here is one volume assembly
accepts. :class:`SeriesHints` is what series completion (:mod:`segnode.node.ingest.series`)
reads from it. Fed by the streaming decoder (:mod:`segnode.node.ingest.streaming`); it holds
no state of its own beyond one series' slices and touches neither the ledger nor the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from segnode.node.ingest.volume import (
    DUPLICATE_TOLERANCE_MM,
    GAP_TOLERANCE_FRACTION,
    GAP_TOLERANCE_MM,
    ORIENTATION_TOLERANCE,
)


@dataclass(frozen=True)
class SeriesHints:
    """The series' extent as its headers tell it (from the streaming decoder)."""

    #: Instances decoded so far.
    received: int
    #: Images in Acquisition (0020,1002), when every instance agrees on it.
    expected: int | None = None
    #: Whether the stack is geometrically complete (uniform, no gap, as many as expected).
    complete: bool = False
    #: Instance Numbers missing between the lowest and highest received (a hole).
    missing_numbers: int = 0
    #: The first of them.
    first_missing: int | None = None
    #: Instances received but not decoded yet: the other fields may under-count them.
    behind: int = 0

    def incomplete_reason(self) -> str | None:
        """Why the headers say more instances will come, or None."""
        if self.complete:
            return None
        if self.expected is not None and self.received < self.expected:
            return f"{self.received} of {self.expected} instances received (Images in Acquisition)"
        if self.missing_numbers:
            return (
                f"{self.missing_numbers} Instance Number(s) missing between those received "
                f"(the first: {self.first_missing})"
            )
        return None


class SeriesGeometry:
    """Slice positions received for one series, to tell when the stack is complete.

    Uses the tolerances of :mod:`segnode.node.ingest.volume`, so a stack called complete here is one
    that volume assembly accepts (same orientation, no duplicate, uniform spacing).
    """

    def __init__(self) -> None:
        self.positions: dict[str, npt.NDArray[np.float64]] = {}
        self.orientation: npt.NDArray[np.float64] | None = None
        self.expected: int | None = None
        self.mixed = False
        self.fired = False
        self.numbers: set[int] = set()

    def add(
        self,
        sop_uid: str,
        position: npt.NDArray[np.float64] | None,
        orientation: npt.NDArray[np.float64] | None,
        expected: int | None,
        number: int | None = None,
    ) -> bool:
        """Record one slice; True exactly once, when the stack first becomes complete.

        Parameters
        ----------
        position, orientation
            Image Position / Orientation (Patient); None when the instance lacks them (the
            series can then never be called complete by geometry).
        expected
            The instance's Images in Acquisition, if present.
        """
        if number is not None:
            self.numbers.add(number)
        if position is None or orientation is None:
            self.mixed = True
        elif self.orientation is None:
            self.orientation = orientation
        elif float(np.max(np.abs(orientation - self.orientation))) > ORIENTATION_TOLERANCE:
            self.mixed = True
        if expected is not None:
            if self.expected is not None and expected != self.expected:
                self.mixed = True
            self.expected = expected
        if position is not None:
            self.positions[sop_uid] = position
        if self.fired or self.mixed or self.expected is None:
            return False
        if len(self.positions) != self.expected:
            return False
        self.fired = uniform_stack(list(self.positions.values()), self.orientation)
        return self.fired

    def hints(self) -> SeriesHints:
        """What the slices recorded so far say about the series' extent."""
        missing, first = 0, None
        if len(self.numbers) >= 2:
            lo, hi = min(self.numbers), max(self.numbers)
            missing = hi - lo + 1 - len(self.numbers)
            if missing:
                first = next(n for n in range(lo, hi + 1) if n not in self.numbers)
        # More slices than Images in Acquisition said: the count was wrong, and so is any
        # completeness told from it (each later instance would complete the series again).
        overrun = self.expected is not None and len(self.positions) > self.expected
        return SeriesHints(
            received=len(self.positions),
            expected=None if self.mixed or overrun else self.expected,
            complete=self.fired and not overrun,
            missing_numbers=missing,
            first_missing=first,
        )


def uniform_stack(
    positions: list[npt.NDArray[np.float64]], orientation: npt.NDArray[np.float64] | None
) -> bool:
    """Whether slice positions form a gap-free stack with uniform spacing along the normal."""
    if orientation is None or len(positions) < 2:
        return False
    normal = np.cross(orientation[:3], orientation[3:])
    norm = float(np.linalg.norm(normal))
    if norm < 1e-6:
        return False
    d = np.sort(np.asarray(positions) @ (normal / norm))
    gaps = np.diff(d)
    if bool(np.any(gaps < DUPLICATE_TOLERANCE_MM)):
        return False
    median = float(np.median(gaps))
    tolerance = max(GAP_TOLERANCE_MM, GAP_TOLERANCE_FRACTION * median)
    return bool(np.all(np.abs(gaps - median) <= tolerance))
