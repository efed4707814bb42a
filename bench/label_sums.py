"""Per-label HU sums on the GPU, masked reductions against bincounts:
``python -m bench.label_sums [--slices 300] [--labels 6 118]``.

The torch engine sums a trained model's label map per value where it is
(:meth:`segnode.engines.torch_backend.TorchEngine.label_sums`): one masked reduction per value
up to :data:`~segnode.engines.torch_backend.MASKED_SUMS_MAX` values, three ``torch.bincount``
above. This times both ways on a 512 x 512 x ``--slices`` map of blobs (integer HU) for each
``--labels`` count and checks that they agree exactly; medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    import torch

    from segnode.engines import torch_backend

    p = argparse.ArgumentParser(prog="python -m bench.label_sums")
    p.add_argument("--slices", type=int, default=300)
    p.add_argument("--labels", type=int, nargs="+", default=[6, 118])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (args.slices, 512, 512)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    hu = torch.randint(-1024, 3000, shape, device=dev, generator=gen).to(torch.float32)
    engine = torch_backend.TorchEngine(device=args.device)
    engine._torch, engine._dev = torch, dev
    rows: list[dict[str, Any]] = []
    saved = torch_backend.MASKED_SUMS_MAX
    for n in args.labels:
        # blobs: each 8^3 block one value, background (0) on about 70 % of the volume
        coarse = torch.randint(1, n, (shape[0] // 8 + 1, 65, 65), device=dev, generator=gen)
        coarse[torch.rand(coarse.shape, device=dev, generator=gen) < 0.7] = 0
        labels = coarse.repeat_interleave(8, 0).repeat_interleave(8, 1).repeat_interleave(8, 2)
        labels = labels[: shape[0], :512, :512].to(torch.uint8).contiguous()
        engine.manifest = type("M", (), {"num_classes": n})()  # type: ignore[assignment]
        row: dict[str, Any] = {"labels": n, "slices": args.slices}
        results = {}
        for way, limit in (("masked", 10**9), ("bincount", 0)):
            torch_backend.MASKED_SUMS_MAX = limit
            times = []
            for _ in range(args.runs + 1):
                sync()
                t = time.perf_counter()
                results[way] = engine._label_sums(labels, hu)
                sync()
                times.append(time.perf_counter() - t)
            row[f"{way}_ms"] = round(statistics.median(times[1:]) * 1e3, 2)
        row["equal"] = bool(torch.equal(results["masked"], results["bincount"]))
        torch_backend.MASKED_SUMS_MAX = saved
        rows.append(row)
        print(json.dumps(row), flush=True)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
