"""Outage scenario: the destination is down for a while, then back; everything arrives once.

Run::

    .venv/bin/python -m scripts.outage --down-s 120 [--series 3]

``segnode serve`` runs with the shipped ``[dispatch]`` defaults (backoff from 5 s doubling to
300 s with jitter, breaker after 5 connection failures, 60 s cool-down) and one destination,
a :class:`~scripts.harness.CountingSCP` that is not listening yet. The script sends
``--series`` small series, keeps the destination down for ``--down-s`` seconds after the
first result was ready, starts it, and waits until every job is ``sent``. It prints, from the
ledger, each delivery's attempts and status, the number of connection attempts while down
(``destination-down`` events), and how many times the destination received each object.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.harness import CountingSCP, NodeRunner, free_port, send_files, write_config
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series


def ledger_rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """Run a read query on the ledger."""
    con = sqlite3.connect(db, timeout=30)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def run(workdir: Path, down_s: float, series: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The scenario; returns the figures."""
    scp_port = free_port()
    scp = CountingSCP(scp_port)
    port = free_port()
    data = workdir / "data"
    cfg = write_config(
        workdir / "config.toml", data, port, dispatch={"destinations": [scp.peer], **extra}
    )
    node = NodeRunner(cfg, data, port, workdir / "node.log")
    node.start()
    db = data / "ledger.sqlite"
    try:
        for i in range(series):
            files = write_synthetic_series(
                workdir / f"s{i}", PhantomGeometry(rows=64, columns=64, slices=8), seed=88000 + i
            )
            assert send_files(files, port).complete
        t0 = time.monotonic()
        while not ledger_rows(db, "SELECT 1 FROM jobs WHERE state='encoded'"):
            time.sleep(0.2)
        down_at = time.monotonic()
        print(f"results ready after {down_at - t0:.1f} s; destination down for {down_s:.0f} s")
        time.sleep(down_s)
        scp.start()
        up_at = time.monotonic()
        print("destination up")
        while ledger_rows(db, "SELECT 1 FROM jobs WHERE state NOT IN ('sent','failed')"):
            time.sleep(0.5)
        all_sent = time.monotonic()
        time.sleep(2.0)  # anything more would be a duplicate
    finally:
        node.stop()
        scp.stop()
    deliveries = ledger_rows(
        db,
        "SELECT d.job_id, r.kind, d.status, d.attempts, d.last_error FROM deliveries d "
        'JOIN results r ON r.id = d.result_id ORDER BY d.job_id, r."order"',
    )
    down_events = ledger_rows(
        db, "SELECT at, message FROM events WHERE kind='destination-down' ORDER BY id"
    )
    counts = scp.counts()
    return {
        "down_s": down_s,
        "series": series,
        "deliveries": [
            {"job": j, "kind": k, "status": s, "attempts": a, "last_error": e}
            for j, k, s, a, e in deliveries
        ],
        "connection_attempts_while_down": len(down_events),
        "connection_attempt_times": [str(a) for a, _ in down_events],
        "received": dict(counts),
        "objects": len(counts),
        "max_received_per_object": max(counts.values()) if counts else 0,
        "seconds_from_up_to_all_sent": round(all_sent - up_at, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--down-s", type=float, default=120.0)
    p.add_argument("--series", type=int, default=3)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--dispatch",
        default="{}",
        help="JSON overrides of [dispatch], e.g. '{\"breaker_failures\": 3}'",
    )
    args = p.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="segnode-outage-"))
    work.mkdir(parents=True, exist_ok=True)
    r = run(work, args.down_s, args.series, json.loads(args.dispatch))
    for d in r["deliveries"]:
        print(f"job {d['job']} {d['kind']}: {d['status']}, {d['attempts']} attempt(s)")
    print(
        f"connection attempts while down: {r['connection_attempts_while_down']} at "
        f"{', '.join(t[11:19] for t in r['connection_attempt_times'])}"
    )
    print(
        f"destination received {r['objects']} objects, at most {r['max_received_per_object']} "
        f"time(s) each; all sent {r['seconds_from_up_to_all_sent']} s after it came back"
    )
    if args.out:
        args.out.write_text(json.dumps(r, indent=2))
    ok = r["max_received_per_object"] == 1 and r["objects"] == 2 * args.series
    ok = ok and all(d["status"] == "sent" for d in r["deliveries"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
