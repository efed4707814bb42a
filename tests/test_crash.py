"""Crash safety: SIGKILL ``segnode serve`` at random points, restart, check the invariants.

A reduced run of :mod:`scripts.crash_harness` (``python -m scripts.crash_harness --trials 50``
is the full one): one node, a counting destination, small series with distinct seeds. See the
harness for the invariants (acknowledged means durable; one job, one SEG and one SR per series,
same SOP Instance UIDs on a resend; nothing stuck).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from scripts.crash_harness import CrashHarness
from tests.fixtures.synthetic import PhantomGeometry

pytestmark = [pytest.mark.slow, pytest.mark.interop]


def test_random_sigkills_keep_the_invariants(tmp_path: Path) -> None:
    h = CrashHarness(
        tmp_path,
        geometry=PhantomGeometry(rows=64, columns=64, slices=10),
        scp_delay=0.2,
        quiet_period_s=4.0,
        rng=random.Random(20240),
    )
    try:
        report = h.run(6, base_seed=91000)
    finally:
        h.close()
    print(report.summary())
    assert report.trials == 6
    assert report.violations == 0, report.summary()
