"""The SEG of many segments while the node's other threads hold the interpreter lock:
``python -m bench.seg_contention``.

A 117-structure label map (:func:`bench.seg_size.blob_labels`, 300 x 512 x 512 by default) is
encoded, written and checked as a job does after its model
(:func:`segnode.node.results.encode_process.encode_and_write`), ``--runs`` times each:

* ``node``: in this process (``[results] encode_processes = 0``);
* ``process``: in an encoder process (``encode_processes = 1``), the label map copied to it
  through shared memory;

each with no other thread, and with ``--load`` Python threads that stand for a burst's
receiving threads: each holds the interpreter lock in pure Python for ``--busy-ms``, then
sleeps ``--idle-ms``. Printed: per variant the medians of the SEG's wall time and of the
Python work the load threads got done meanwhile (loops per second, against those threads
alone), and the ratio of the SEG's time in the node to its time in the process under load.
``--out DIR`` writes ``seg_contention.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

from pydicom.uid import DeflatedExplicitVRLittleEndian

from bench.seg_size import FULL_SHAPE, blob_labels, blob_manifest, blob_volume, machine
from segnode.node import __version__
from segnode.node.results.build import Equipment, ResultUIDs, load_standard_tables
from segnode.node.results.encode_process import SegEncoders, encode_and_write
from segnode.node.results.seg_encode import SegPlan


class Load:
    """``threads`` Python threads, each busy ``busy`` s then idle ``idle`` s, counting
    loops."""

    def __init__(self, threads: int, busy: float, idle: float) -> None:
        self.threads, self.busy, self.idle = threads, busy, idle
        self.loops = 0
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            until = time.perf_counter() + self.busy
            while time.perf_counter() < until:
                for _ in range(200):
                    n += 1
            if self.idle:
                time.sleep(self.idle)
        self.loops += n

    def __enter__(self) -> Load:
        self._stop.clear()
        self.loops = 0
        self._workers = [threading.Thread(target=self._spin) for _ in range(self.threads)]
        for t in self._workers:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._workers:
            t.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, default=FULL_SHAPE, metavar=("Z", "Y", "X"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load", type=int, default=2, help="busy Python threads beside the SEG")
    parser.add_argument("--busy-ms", type=float, default=5.0)
    parser.add_argument("--idle-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    shape = tuple(args.shape)
    load_standard_tables()
    labels = blob_labels(shape)  # type: ignore[arg-type]
    volume = blob_volume(shape)  # type: ignore[arg-type]
    manifest = blob_manifest()
    work = Path(tempfile.mkdtemp(prefix="seg-contention-"))
    encoders = SegEncoders(1)
    encoders.start()
    helper = ThreadPoolExecutor(2)
    results: dict[str, Any] = {"machine": machine(), "shape": shape, "load": vars(args).copy()}
    results["load"].pop("out")
    # the load threads alone: their loops per second
    with Load(args.load, args.busy_ms / 1e3, args.idle_ms / 1e3) as alone:
        time.sleep(2.0)
    alone_rate = alone.loops / 2.0

    def one(where: str, k: int) -> float:
        plan = SegPlan.prepare(
            volume,
            manifest,
            ResultUIDs.new(),
            transfer_syntax=DeflatedExplicitVRLittleEndian,
            equipment=Equipment.for_seg(__version__),
            created=datetime.now(),
        )
        path = work / f"{where}-{k}" / "seg.dcm"
        started = time.perf_counter()
        if where == "node":
            written = encode_and_write(plan, labels, path, helper)
        else:
            written = encoders.submit(plan, labels, path).result()
        seconds = time.perf_counter() - started
        written.temp.unlink()
        return seconds

    try:
        for where in ("node", "process"):
            for loaded in (False, True):
                name = f"{where}{' + load' if loaded else ''}"
                times, rates = [], []
                for k in range(args.runs):
                    if loaded:
                        with Load(args.load, args.busy_ms / 1e3, args.idle_ms / 1e3) as load:
                            seconds = one(where, k)
                        rates.append(load.loops / seconds / alone_rate)
                    else:
                        seconds = one(where, k)
                    times.append(seconds)
                row = {
                    "seg_s": round(statistics.median(times), 3),
                    "runs": [round(t, 3) for t in times],
                }
                if rates:
                    row["load_work_share"] = round(statistics.median(rates), 3)
                results[name] = row
                print(f"[seg-contention] {name}: {row}", flush=True)
    finally:
        encoders.close()
        helper.shutdown()
    ratio = results["node + load"]["seg_s"] / results["process + load"]["seg_s"]
    results["node_over_process_under_load"] = round(ratio, 2)
    print(
        f"[seg-contention] {shape}, 117 structures, load {args.load} x "
        f"{args.busy_ms:g}/{args.idle_ms:g} ms: SEG under load {results['node + load']['seg_s']} s "
        f"in the node, {results['process + load']['seg_s']} s in a process ({ratio:.2f}x)"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "seg_contention.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
