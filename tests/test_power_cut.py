"""Power cuts: the node's data folder on the lazy file system of :mod:`scripts.lazyfs`, which
forgets at a cut every write and every name not yet fsynced (strict mode); nothing
acknowledged may be lost.

A reduced run of :mod:`scripts.power_harness` (``python -m scripts.power_harness --trials
100`` is the full one): cuts during the C-STORE stream, between the release and the job,
during inference, encoding and sending, with one association per series or per instance.
The same with two nodes on a PostgreSQL ledger, the cuts under one of them (``--postgres
--trials 20``).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from scripts.lazyfs import fuse_usable
from tests.conftest import require_tool
from tests.fixtures.synthetic import PhantomGeometry

pytestmark = [pytest.mark.slow, pytest.mark.interop]

WHY = fuse_usable()


@pytest.mark.skipif(WHY is not None, reason=f"FUSE is not usable here: {WHY}")
def test_random_power_cuts_lose_nothing_acknowledged(tmp_path: Path) -> None:
    from scripts.power_harness import MODES, STORESCU_MODES, PowerCutHarness

    require_tool("storescu")  # DCMTK as one of the modalities
    h = PowerCutHarness(
        tmp_path,
        modes=MODES + STORESCU_MODES,
        geometry=PhantomGeometry(rows=64, columns=64, slices=10),
        scp_delay=0.2,
        quiet_period_s=6.0,
        rng=random.Random(20261218),  # the four send modes in five trials
    )
    try:
        report = h.run(5, base_seed=93000)
    finally:
        h.close()
    print(report.summary())
    assert report.trials == 5
    assert report.acknowledged > 0  # cuts came after something was acknowledged
    assert report.lost == 0 and report.violations == 0, report.summary()


@pytest.mark.skipif(WHY is not None, reason=f"FUSE is not usable here: {WHY}")
def test_power_cuts_under_one_of_two_nodes_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    from scripts.power_postgres import PostgresPowerHarness

    h = PostgresPowerHarness(
        tmp_path,
        url=pg_url,
        lease_s=3.0,
        geometry=PhantomGeometry(rows=64, columns=64, slices=10),
        scp_delay=0.2,
        quiet_period_s=6.0,
        rng=random.Random(20261207),
    )
    try:
        report = h.run(4, base_seed=94000)
    finally:
        h.close()
    print(report.summary())
    assert report.trials == 4
    assert report.acknowledged > 0
    assert report.lost == 0 and report.violations == 0, report.summary()
