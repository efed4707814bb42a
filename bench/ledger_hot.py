"""The ledger's per-instance hot path on SQLite and on PostgreSQL, measured in the same run.

Records the instances of ``--series`` series of ``--slices`` instances each (the SCP's
``has_instance`` + ``record_instance`` per C-STORE, one thread per series as concurrent
associations do) into a new ledger of each kind, ``--runs`` times, and prints the median
instances per second and the ratio PostgreSQL / SQLite. PostgreSQL runs as a throwaway
cluster on loopback (Debian's ``postgresql``; tests/fixtures/postgres.py), so the figure is
the protocol and server cost without a network.

    python -m bench.ledger_hot --series 4 --slices 256 --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from segnode.storage.ledger import InstanceRecord, Ledger
from segnode.storage.migrations import upgrade_database
from tests.fixtures.postgres import PostgresCluster, postgres_bin


def record_all(ledger: Ledger, series: int, slices: int, run: int) -> float:
    """Seconds to record every instance, one thread per series."""

    def one(k: int) -> None:
        for n in range(slices):
            sop = f"1.2.826.0.1.{run}.{k}.{n}"
            rec = InstanceRecord(
                sop, "1.2.840.10008.5.1.4.1.1.2", f"1.2.826.0.2.{run}.{k}", f"1.2.826.0.3.{run}",
                "1.2.840.10008.1.2.1", "CT", "BENCH",
            )  # fmt: skip
            if not ledger.has_instance(sop):
                ledger.record_instance(rec, Path("/spool") / sop, 525_000)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(series)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main() -> None:
    """Run the benchmark and print its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", type=int, default=4)
    ap.add_argument("--slices", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    bindir = postgres_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    cluster = PostgresCluster(bindir)
    n = args.series * args.slices
    rates: dict[str, list[float]] = {"sqlite": [], "postgresql": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(args.runs):  # alternate the two, so drift hits both alike
                for kind in rates:
                    if kind == "sqlite":
                        ledger = Ledger(Path(tmp) / f"ledger-{run}.sqlite")
                    else:
                        url = cluster.database()
                        upgrade_database(url)
                        ledger = Ledger(url=url)
                    try:
                        rates[kind].append(n / record_all(ledger, args.series, args.slices, run))
                    finally:
                        ledger.close()
    finally:
        cluster.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{n} instances ({args.series} concurrent series), median of {args.runs} runs:")
    for kind, v in rates.items():
        print(
            f"  {kind:<10} {med[kind]:8.0f} instances/s  (runs: {', '.join(f'{r:.0f}' for r in v)})"
        )
    print(f"  ratio PostgreSQL / SQLite: {med['postgresql'] / med['sqlite']:.2f}")


if __name__ == "__main__":
    main()
