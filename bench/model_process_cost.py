"""What a job pays for running its model in a process of its own:
``python -m bench.model_process_cost``.

The bundled default model (ONNX Runtime, ``--threads``) segments one synthetic volume of
``--slices`` x 512 x 512 ``--rounds`` times in this process and, alternately, through a
:class:`~segnode.engines.model_process.ProcessEngine` (``[engine] model_process = true``):
the volume copied into a shared file, the child's model, the label map mapped back. Printed:
each round's seconds, the medians, and the process' extra seconds per job (median against
median); the first round of the process includes its shared files' first use. ``--out DIR``
writes ``model_process_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from bench.seg_size import machine
from segnode.engines import create_engine, load_manifest
from segnode.engines.model_process import ProcessEngine
from segnode.engines.models import default_manifest_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    manifest = load_manifest(default_manifest_path())
    rng = np.random.default_rng(0)
    hu = rng.normal(0.0, 400.0, (args.slices, 512, 512)).astype(np.float32)
    inside = create_engine("onnxruntime", threads=args.threads)
    inside.load(manifest)
    child = ProcessEngine("onnxruntime", {"threads": args.threads})
    child.load(manifest)
    node_s: list[float] = []
    process_s: list[float] = []
    try:
        for _ in range(args.rounds):
            started = time.perf_counter()
            want = inside.segment(hu)
            node_s.append(round(time.perf_counter() - started, 3))
            started = time.perf_counter()
            got, _ = child.segment_job(hu)
            process_s.append(round(time.perf_counter() - started, 3))
            if not np.array_equal(got, want):
                raise SystemExit("the model process gave another label map")
            del want, got
    finally:
        child.close()
    result = {
        "when": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "shape": list(hu.shape),
        "threads": args.threads,
        "node_s": node_s,
        "process_s": process_s,
        "node_median_s": round(statistics.median(node_s), 3),
        "process_median_s": round(statistics.median(process_s), 3),
        "extra_s": round(statistics.median(process_s) - statistics.median(node_s), 3),
    }
    print(f"[model-process-cost] {result['shape']}: in the node {node_s}")
    print(f"[model-process-cost] {result['shape']}: in a process {process_s}")
    print(
        f"[model-process-cost] medians {result['node_median_s']} s / "
        f"{result['process_median_s']} s: the process adds {result['extra_s']} s per job"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "model_process_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
