"""Time the default model on the CPU: ``engine.segment`` on a synthetic 512x512 CT.

``python -m bench.tissue_cpu [--baseline DIR] [--runs 5] [--slices 128]``

Each tree (this one, and ``--baseline``, another checkout such as ``git archive <commit> | tar
-x -C DIR``) gets a worker process that builds the synthetic series
(``tests.fixtures.synthetic.synthetic_datasets(PhantomGeometry(slices=N), seed=0)`` assembled by
``segnode.node.ingest.volume.assemble_from_datasets``), loads the tree's default model with
``segnode.engines.base.create_engine("onnxruntime")`` (default threads) and segments once to warm
up. The runs then alternate between the workers, one ``segment`` at a time, so that both see the
same machine load; the medians are printed with every run, and whether the label maps are
identical (SHA-256 of the uint8 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

WORKER = """
import hashlib, json, sys, time
import numpy as np
from segnode.engines.base import create_engine
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.models import default_manifest_path
from tests.fixtures.synthetic import synthetic_datasets
from segnode.node.ingest.volume import assemble_from_datasets

slices = int(sys.argv[1])
try:
    from tests.fixtures.synthetic import PhantomGeometry
except ImportError:  # a baseline tree from before PhantomGeometry
    datasets = synthetic_datasets(slices=slices, seed=0)
else:
    datasets = synthetic_datasets(PhantomGeometry(slices=slices), seed=0)
hu = assemble_from_datasets(datasets).hu
engine = create_engine("onnxruntime")
engine.load(load_manifest(default_manifest_path()))
labels = engine.segment(hu)
digest = hashlib.sha256(np.ascontiguousarray(labels).tobytes()).hexdigest()
print(json.dumps({"sha256": digest, "shape": list(hu.shape)}), flush=True)
for line in sys.stdin:
    started = time.perf_counter()
    engine.segment(hu)
    print(time.perf_counter() - started, flush=True)
"""


class _Worker:
    def __init__(self, tree: Path, slices: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.tree = tree
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(slices)],
            cwd=tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = json.loads(self._line())
        self.runs: list[float] = []

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker in {self.tree} exited ({self.process.wait()})")
        return line

    def run(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        self.runs.append(float(self._line()))

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--slices", type=int, default=128)
    args = parser.parse_args(argv)
    trees = [Path(__file__).resolve().parents[1]]
    if args.baseline:
        trees.insert(0, args.baseline.resolve())
    workers = [_Worker(tree, args.slices) for tree in trees]
    try:
        for _ in range(args.runs):
            for worker in workers:
                worker.run()
    finally:
        for worker in workers:
            worker.close()
    print(f"{os.cpu_count()} CPUs, 512x512x{args.slices}, {args.runs} runs each, alternating")
    for worker in workers:
        runs = ", ".join(f"{t:.3f}" for t in worker.runs)
        print(f"{worker.tree}: median {statistics.median(worker.runs):.3f} s ({runs})")
    digests = {worker.info["sha256"] for worker in workers}
    print("label maps identical" if len(digests) == 1 else f"label maps DIFFER: {digests}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
