"""SEG size, encoding time and viewer load time of a 117-structure segmentation (issue 34):
``python -m bench.seg_size [--out DIR]``.

A synthetic CT of 512 x 512 x 300 (0.8 mm pixels, 1.5 mm slices) gets a label map of 117
blobs with the sizes and shapes of TotalSegmentator's structures (:func:`blob_labels`: organs,
vertebrae, ribs, muscles, vessels, glands). For each encoding the node offers

* BINARY, Explicit VR Little Endian (uncompressed);
* BINARY, Deflated Explicit VR Little Endian (the default);
* LABELMAP, Explicit VR Little Endian;
* LABELMAP, Deflated Explicit VR Little Endian;

it measures the file's size and the medians over ``--runs`` runs of
:meth:`~segnode.node.results.seg_encode.SegPlan.encode` and
:func:`~segnode.node.results.seg_check.check_encoded` (what the worker spends after the label
map exists), then loads the file with the web viewers' readers under Node.js
(``tests/node/read_seg.mjs``: dcmjs's ``generateToolState`` and ``@cornerstonejs/adapters``,
OHIF 3's loader): their medians over ``--node-runs`` runs, peak resident memory, and whether
their label map equals ours voxel for voxel. Prints a table and a line for
docs/performance.md; ``--out DIR`` writes ``seg_size.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from pydicom.uid import DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian

from segnode.engines.manifest import LabelSpec, ModelManifest
from segnode.node.ingest.volume import Volume, assemble_from_datasets
from segnode.node.pipeline.parallel import threads
from segnode.node.results.build import Equipment, ResultUIDs
from segnode.node.results.seg_check import check_encoded
from segnode.node.results.seg_encode import SegPlan
from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets

STRUCTURES = 117
TISSUE = ("85756007", "SCT", "Tissue")
#: The full-size grid the structures' sizes are given for: (slices, rows, columns), mm.
FULL_SHAPE = (300, 512, 512)
FULL_SPACING = (1.5, 0.8, 0.8)


# ---------------------------------------------------------------------------- the labels


@dataclass(frozen=True)
class Kind:
    """A kind of structure: how many, their volume (mL) and the ratio of their (z, y, x)
    semi-axes; ``rim`` places them near the body's outline (ribs, muscles), ``spine`` in a
    column along z (vertebrae)."""

    count: int
    volume_ml: tuple[float, float]
    shape: tuple[float, float, float]
    rim: bool = False
    spine: bool = False


#: 24 organs, 26 vertebrae, 24 ribs, 23 muscles, 14 vessels and heart chambers, 6 glands and
#: small organs: 117.
KINDS = (
    Kind(24, (40.0, 1600.0), (1.2, 1.0, 1.1)),
    Kind(26, (15.0, 70.0), (0.55, 1.0, 1.2), spine=True),
    Kind(24, (6.0, 18.0), (0.25, 0.35, 3.5), rim=True),
    Kind(23, (60.0, 900.0), (3.0, 0.8, 1.0), rim=True),
    Kind(14, (20.0, 250.0), (6.0, 1.0, 1.0)),
    Kind(6, (2.0, 15.0), (1.0, 0.8, 1.0)),
)


def blob_labels(
    shape: tuple[int, int, int] = FULL_SHAPE, *, structures: int = STRUCTURES, seed: int = 34
) -> npt.NDArray[np.uint8]:
    """A label map of ``shape`` (slices, rows, columns) holding labels 1..``structures``.

    Each structure is an ellipsoid whose radius wobbles with the angle around z, sized as
    :data:`KINDS` says on the :data:`FULL_SHAPE` grid of :data:`FULL_SPACING` and scaled
    with ``shape`` along each axis; the largest are painted first, so that every structure
    keeps voxels. Reproducible for a ``seed``.
    """
    rng = np.random.default_rng(seed)
    slices, rows, columns = shape
    scale = np.array(shape, dtype=np.float64) / np.array(FULL_SHAPE)
    spacing = np.array(FULL_SPACING)
    body = (rows * 0.34, columns * 0.44)  # the body's elliptic outline, semi-axes in voxels
    centre = (slices / 2, rows / 2, columns / 2)
    kinds = [kind for kind in KINDS for _ in range(kind.count)][:structures]
    blobs = []
    for i, kind in enumerate(kinds):
        volume_mm3 = rng.uniform(*kind.volume_ml) * 1000.0
        ratio = np.array(kind.shape)
        unit = float(volume_mm3 / (4.0 / 3.0 * np.pi * np.prod(ratio))) ** (1.0 / 3.0)
        radii = ratio * unit / spacing * scale  # voxels of this grid
        angle = rng.uniform(0, 2 * np.pi)
        if kind.spine:
            index = i - sum(k.count for k in KINDS[: KINDS.index(kind)])
            z = slices * (0.04 + 0.92 * index / max(1, kind.count - 1))
            y, x = centre[1] + body[0] * 0.55, centre[2]
        elif kind.rim:
            z = rng.uniform(0.1, 0.9) * slices
            y = centre[1] + body[0] * 0.85 * np.sin(angle)
            x = centre[2] + body[1] * 0.85 * np.cos(angle)
        else:
            r = np.sqrt(rng.uniform(0, 0.5))
            z = rng.uniform(0.1, 0.9) * slices
            y = centre[1] + body[0] * r * np.sin(angle)
            x = centre[2] + body[1] * r * np.cos(angle)
        blobs.append((float(np.prod(radii)), (z, y, x), tuple(radii.tolist())))
    labels = np.zeros(shape, dtype=np.uint8)
    for value in sorted(range(len(blobs)), key=lambda j: -blobs[j][0]):
        _, where, radii = blobs[value]
        _paint(labels, value + 1, where, radii, rng)
    return labels


def _paint(
    labels: npt.NDArray[np.uint8],
    value: int,
    centre: tuple[float, float, float],
    radii: tuple[float, ...],
    rng: np.random.Generator,
) -> None:
    """An ellipsoid of ``value`` whose radius wobbles with the angle around z (at least the
    voxel nearest its centre)."""
    radii = tuple(max(r, 0.5) for r in radii)
    lows = [max(0, int(np.floor(c - r * 1.2))) for c, r in zip(centre, radii, strict=True)]
    highs = [
        min(n, int(np.ceil(c + r * 1.2)) + 1)
        for c, r, n in zip(centre, radii, labels.shape, strict=True)
    ]
    if any(h <= lo for lo, h in zip(lows, highs, strict=True)):
        return
    z, y, x = np.ogrid[lows[0] : highs[0], lows[1] : highs[1], lows[2] : highs[2]]
    dz, dy, dx = (z - centre[0]) / radii[0], (y - centre[1]) / radii[1], (x - centre[2]) / radii[2]
    phase, lobes = rng.uniform(0, 2 * np.pi), int(rng.integers(2, 6))
    wobble = 1.0 + 0.12 * np.sin(lobes * np.arctan2(dy, dx) + phase + 0.3 * dz)
    inside = dz * dz + dy * dy + dx * dx <= wobble * wobble
    box = labels[lows[0] : highs[0], lows[1] : highs[1], lows[2] : highs[2]]
    box[inside] = value
    nearest = tuple(
        min(max(int(round(c)), 0), n - 1) for c, n in zip(centre, labels.shape, strict=True)
    )
    labels[nearest] = value


def blob_manifest(structures: int = STRUCTURES) -> ModelManifest:
    """A manifest of ``structures`` labels ``structure_001``... (values 1..n, SNOMED CT
    "Tissue", colours apart), for :func:`blob_labels`."""
    labels = tuple(
        LabelSpec(
            value=k,
            name=f"structure_{k:03d}",
            category=TISSUE,
            type=TISSUE,
            color=((37 * k) % 256, (91 * k) % 256, (53 * k) % 256),
        )
        for k in range(1, structures + 1)
    )
    return ModelManifest(
        name="blobs",
        version="1.0.0",
        onnx_path=Path("blobs.onnx"),
        labels=labels,
        patch_size=(64, 64, 64),
    )


def blob_volume(shape: tuple[int, int, int] = FULL_SHAPE) -> Volume:
    """A synthetic axial CT of ``shape`` covering the body of :data:`FULL_SHAPE` at
    :data:`FULL_SPACING`."""
    slices, rows, columns = shape
    geometry = PhantomGeometry(
        rows=rows,
        columns=columns,
        slices=slices,
        pixel_spacing=FULL_SPACING[1] * FULL_SHAPE[1] / rows,
        slice_spacing=FULL_SPACING[0] * FULL_SHAPE[0] / slices,
    )
    return assemble_from_datasets(synthetic_datasets(geometry))


# ----------------------------------------------------------------------------- the bench

VARIANTS = (
    ("BINARY", ExplicitVRLittleEndian),
    ("BINARY", DeflatedExplicitVRLittleEndian),
    ("LABELMAP", ExplicitVRLittleEndian),
    ("LABELMAP", DeflatedExplicitVRLittleEndian),
)


def _name(kind: str, syntax: str) -> str:
    return f"{kind} {'deflated' if syntax == DeflatedExplicitVRLittleEndian else 'explicit'}"


def measure(
    volume: Volume, labels: npt.NDArray[np.uint8], kind: str, syntax: str, runs: int
) -> tuple[dict[str, Any], bytes]:
    """Size and median encode / check seconds of one encoding; the file."""
    plan = SegPlan.prepare(
        volume,
        blob_manifest(),
        ResultUIDs.new(),
        segmentation_type=kind,
        transfer_syntax=syntax,
        equipment=Equipment.for_seg("bench"),
    )
    encodes, checks, totals = [], [], []
    data = b""
    for _ in range(runs):
        started = time.perf_counter()
        encoded = plan.encode(labels)
        encoded_at = time.perf_counter()
        check_encoded(plan, encoded, labels)
        done = time.perf_counter()
        encodes.append(encoded_at - started)
        checks.append(done - encoded_at)
        totals.append(done - started)
        data = encoded.data
        del encoded
    row = {
        "variant": _name(kind, syntax),
        "mb": len(data) / 1e6,
        "frames": int(encoded_frames(data)),
        "encode_s": statistics.median(encodes),
        "check_s": statistics.median(checks),
        "total_s": statistics.median(totals),
    }
    return row, data


def encoded_frames(data: bytes) -> int:
    """Number of Frames of a SEG file."""
    import io

    import pydicom

    return int(pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True).NumberOfFrames)


def load(
    reader: str,
    seg: Path,
    volume: Volume,
    expected: npt.NDArray[np.integer],
    work: Path,
    runs: int,
) -> dict[str, Any]:
    """Median seconds and peak memory of a Node.js reader over ``runs`` runs, and whether its
    label map is ``expected`` (segment numbers)."""
    from tests.node.harness import read_seg

    seconds, peaks, exact = [], [], True
    for run in range(runs):
        try:
            report = read_seg(reader, seg, volume.sources, work, labels=run == 0)
        except AssertionError as exc:
            lines = str(exc).splitlines()
            why = next((line for line in lines if "Error" in line), lines[-1])
            return {"error": why.split("Error: ", 1)[-1].strip()[:100]}
        seconds.append(report["seconds"])
        peaks.append(report["peak_rss_mib"])
        if run == 0:
            exact = bool(np.array_equal(report["labels"], expected))
    return {
        "seconds": statistics.median(seconds),
        "peak_rss_mib": max(peaks),
        "exact": exact,
    }


def machine() -> str:
    """The CPU model and core count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {threads()} encode threads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--node-runs", type=int, default=3)
    parser.add_argument("--shape", type=int, nargs=3, default=FULL_SHAPE, metavar=("Z", "Y", "X"))
    parser.add_argument("--no-node", action="store_true", help="skip the Node.js readers")
    args = parser.parse_args(argv)
    shape = (args.shape[0], args.shape[1], args.shape[2])
    volume = blob_volume(shape)
    labels = blob_labels(shape)
    print(f"{shape[2]}x{shape[1]}x{shape[0]}, {len(np.unique(labels)) - 1} structures; {machine()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="seg-size-") as tmp:
        work = Path(tmp)
        for kind, syntax in VARIANTS:
            row, data = measure(volume, labels, kind, syntax, args.runs)
            path = work / "seg.dcm"
            path.write_bytes(data)
            del data
            if not args.no_node:
                for reader in ("dcmjs", "cornerstone"):
                    row[reader] = load(reader, path, volume, labels, work, args.node_runs)
            rows.append(row)
            print(json.dumps(row))
    print()
    print(table(rows))
    when = datetime.now(UTC).strftime("%Y-%m-%d")
    default = next(r for r in rows if r["variant"] == "BINARY deflated")
    print()
    print(
        f"{when}, {machine()}: 117-structure SEG of {shape[2]}x{shape[1]}x{shape[0]}, "
        "BINARY deflated "
        f"{default['mb']:.2f} MB, encode + check {default['total_s']:.3f} s "
        f"(`python -m bench.seg_size`)"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"date": when, "machine": machine(), "shape": shape, "rows": rows}
        (args.out / "seg_size.json").write_text(json.dumps(result, indent=2))
    return 0


def _reader_cell(result: dict[str, Any] | None) -> str:
    if result is None:
        return "-"
    if "error" in result:
        return f"fails: {result['error']}"
    exact = "" if result["exact"] else " (labels differ!)"
    return f"{result['seconds']:.2f} s, {result['peak_rss_mib']:.0f} MiB{exact}"


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| SEG | MB | frames | encode s | check s | encode + check s | dcmjs | cornerstone |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['mb']:.2f} | {r['frames']} | {r['encode_s']:.3f} | "
            f"{r['check_s']:.3f} | {r['total_s']:.3f} | {_reader_cell(r.get('dcmjs'))} | "
            f"{_reader_cell(r.get('cornerstone'))} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
