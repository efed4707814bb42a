"""Peak memory of the whole node on one series through a many-label model (issue 37).

``segnode serve`` with the model of ``--manifest`` (for example the TotalSegmentator ``--fast``
stand-in of ``python -m bench.totalseg_standin --out bench/out/standin``: 117 labels, 16.6 M
parameters, ``profile.json`` with TotalSegmentator's settings or ``plain.json`` as ``model
import nnunet`` writes it), a synthetic body CT (512 x 512 x ``--slices``, 0.8 mm pixels,
1.5 mm slices) sent by DCMTK ``storescu`` over one association, the results to a counting
Storage SCP. Prints the node's peak resident set (``VmHWM`` of the process, read while it
runs), the job's own peak (its timing line) and the time from ``storescu``'s exit (the last
C-STORE response) to the SEG and SR acknowledged by the destination (``--rows`` for a smaller
matrix: an A/B against older code that needs far more memory)::

    .venv/bin/python -m bench.memory_node --manifest bench/out/standin/profile.json --slices 300

The node runs under ``prlimit --as`` (``--cap-gib``, default 12) so that a regression fails
instead of taking the machine down.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.harness import (
    CountingSCP,
    NodeRunner,
    free_port,
    peak_rss_mb,
    query_ledger,
    storescu_args,
    write_config,
)
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

ROOT = Path(__file__).resolve().parent.parent


def series(slices: int, rows: int = 512) -> Path:
    """A cached synthetic body CT under bench/generated/."""
    name = f"body{slices}" if rows == 512 else f"body{rows}x{slices}"
    out = ROOT / "bench" / "generated" / name
    done = out.with_name(f"{name}.done")
    if not done.exists():
        geometry = PhantomGeometry(
            rows=rows, columns=rows, slices=slices, pixel_spacing=0.8, slice_spacing=1.5
        )
        write_synthetic_series(out, geometry, seed=3700 + slices)
        done.touch()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--slices", type=int, default=300)
    ap.add_argument("--rows", type=int, default=512, help="rows = columns")
    ap.add_argument("--cap-gib", type=float, default=12.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, help="write the figures as JSON")
    args = ap.parse_args(argv)
    folder = series(args.slices, args.rows)
    work = Path(tempfile.mkdtemp(prefix="segnode-memnode-"))
    scp = CountingSCP().start()
    port = free_port()
    data = work / "data"
    cfg = write_config(
        work / "config.toml",
        data,
        port,
        model={"manifest": str(args.manifest.resolve())},
        dispatch={"destinations": [scp.peer]},
    )
    node = NodeRunner(cfg, data, port, work / "node.log")
    # the node under an address-space cap: a regression fails, the machine stays up
    cap = int(args.cap_gib * 1024**3)
    ready = node.start(timeout=300)
    assert node.pid is not None
    subprocess.run(["prlimit", f"--pid={node.pid}", f"--as={cap}"], check=True)
    t0 = time.time()
    subprocess.run(storescu_args(port, folder), check=True, capture_output=True)
    sent_from = time.time()
    peak = 0.0
    state = None
    rows: list[Any] = []
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if node.alive():
            peak = max(peak, peak_rss_mb(node.pid))
        rows = query_ledger(data, "state, reason", "jobs")
        state = rows[-1]["state"] if rows else None
        if state in ("sent", "failed", "done"):
            break
        if not node.alive():
            state = "node died"
            break
        time.sleep(0.2)
    e2e = time.time() - sent_from
    log = node.log()
    node.stop()
    scp.stop()
    timing = [line for line in log.splitlines() if "timing ms" in line]
    job_peak = re.search(r"peak RSS ([0-9.]+) GiB", timing[-1]) if timing else None
    figures = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "manifest": str(args.manifest),
        "series": f"{args.rows}x{args.rows}x{args.slices}",
        "state": state,
        "reason": rows[-1]["reason"] if rows else None,
        "node_peak_rss_gib": round(peak / 1024, 2),
        "job_peak_rss_gib": float(job_peak[1]) if job_peak else None,
        "send_s": round(sent_from - t0, 2),
        "last_response_to_results_s": round(e2e, 1),
        "ready_s": round(ready, 1),
        "timing_line": timing[-1] if timing else None,
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    return 0 if state == "sent" else 1


if __name__ == "__main__":
    sys.exit(main())
