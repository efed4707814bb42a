"""Time the default model remote (``engine = "kserve"``) against local ONNX Runtime.

``python -m bench.kserve_remote [--runs 3] [--slices 128] [--batch 8]``

Starts KServe's model server (``tests/fixtures/kserve_server.py``, ONNX Runtime behind the v2
protocol) on free loopback ports, builds the synthetic series
(``tests.fixtures.synthetic.synthetic_datasets(PhantomGeometry(slices=N), seed=0)``) and, when
``../shared/data`` has it, reads the CT phantom; then segments each volume with the local
``onnxruntime`` engine and with the ``kserve`` engine over HTTP and gRPC, one warm-up and
``--runs`` timed runs each, and prints the median seconds, patches per second and whether the
label maps equal the local ones. Client and server share the machine: on a small CPU the
figures say what the protocol costs, not what a GPU server would gain.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from segnode.engines.base import create_engine
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.models import default_manifest_path
from segnode.engines.sliding_window import patch_grid
from segnode.node.ingest.volume import assemble_from_datasets
from tests.conftest import PHANTOM
from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets
from tests.test_kserve import KServeServer, _read_series


def _time(engine: Any, hu: Any, runs: int) -> tuple[float, Any]:
    labels = engine.segment(hu)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        engine.segment(hu)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--slices", type=int, default=128)
    parser.add_argument("--batch", type=int, default=None, help="patches per request")
    args = parser.parse_args()
    manifest = load_manifest(default_manifest_path())
    volumes = {
        "synthetic": assemble_from_datasets(
            synthetic_datasets(PhantomGeometry(slices=args.slices))
        ).hu
    }
    if PHANTOM.is_dir():
        volumes["phantom"] = _read_series(PHANTOM)
    log = Path("/tmp") / f"kserve-bench-{time.time_ns()}.log"
    server = KServeServer({manifest.name: manifest.onnx_path}, log).start()
    try:
        for what, hu in volumes.items():
            padded = [max(n, p) for n, p in zip(hu.shape, manifest.patch_size, strict=True)]
            patches = len(patch_grid(padded, manifest.patch_size, manifest.overlap))
            local = create_engine("onnxruntime")
            local.load(manifest)
            seconds, want = _time(local, hu, args.runs)
            local.close()
            print(f"{what} {hu.shape}, {patches} patches")
            print(f"  onnxruntime local: {seconds:.2f} s, {patches / seconds:.1f} patches/s")
            for protocol in ("http", "grpc"):
                engine = create_engine(
                    "kserve", url=server.url(protocol), protocol=protocol, batch_size=args.batch
                )
                engine.load(manifest)
                seconds, labels = _time(engine, hu, args.runs)
                engine.close()
                same = np.array_equal(labels, want)
                print(
                    f"  kserve {protocol}: {seconds:.2f} s, {patches / seconds:.1f} patches/s, "
                    f"labels {'equal' if same else 'DIFFER'}"
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
