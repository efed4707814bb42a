"""How long this machine's disk takes to make an instance durable (``python -m
bench.sync_probe [FOLDER]``): the node's C-STORE handler writes each instance with ``O_DSYNC``
and syncs its folder before it answers, so a sender on one association waits at least this
long per instance. Prints the median and 90th percentile of 100 writes of 512 KiB (a
512 x 512 CT slice) with ``O_DSYNC``, each followed by an fsync of the folder, as JSON."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def probe(folder: Path, count: int = 100, size: int = 512 * 1024) -> dict[str, float]:
    data = os.urandom(size)
    times = []
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        dir_fd = os.open(tmp, os.O_RDONLY)
        try:
            for k in range(count):
                path = os.path.join(tmp, f"{k}.dcm")
                t0 = time.perf_counter()
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DSYNC, 0o600)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                os.fsync(dir_fd)
                times.append(time.perf_counter() - t0)
        finally:
            os.close(dir_fd)
    times.sort()
    return {
        "folder": str(folder),
        "median_ms": round(1e3 * statistics.median(times), 3),
        "p90_ms": round(1e3 * times[int(0.9 * (len(times) - 1))], 3),
    }


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1] if len(sys.argv) > 1 else "."))))
