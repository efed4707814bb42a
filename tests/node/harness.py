"""The web viewers' SEG readers under Node.js: install them once, run ``read_seg.mjs``.

``package.json`` and ``package-lock.json`` here pin dcmjs and ``@cornerstonejs/adapters``
(OHIF 3's SEG loader) with what they import. :func:`install` runs ``npm ci`` into a cache
folder named after the lock file's hash (``$SEGNODE_TOOL_CACHE``, default
``~/.cache/segnode``), once; :func:`read_seg` runs ``read_seg.mjs`` there on a SEG file and
the source CT's metadata (:func:`ct_metadata`) and returns its report: the voxel count of each
segment, the segments it placed on each slice, the seconds and memory the loader took, and
optionally the label map it built.

``python -m tests.node.harness`` installs (``make tools`` runs it), so that the tests need no
network afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from pydicom.dataset import Dataset

HERE = Path(__file__).resolve().parent
FILES = ("package.json", "package-lock.json", "read_seg.mjs")
READERS = ("dcmjs", "cornerstone")
INSTALL_TIMEOUT_S = 600


class Unavailable(RuntimeError):
    """Node.js, npm or the npm registry is missing; the message says which."""


def cache_root() -> Path:
    """Where tools the tests install live: ``$SEGNODE_TOOL_CACHE`` or ``~/.cache/segnode``."""
    configured = os.environ.get("SEGNODE_TOOL_CACHE", "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "segnode"


def install_dir() -> Path:
    """The cache folder of this lock file's packages."""
    digest = hashlib.sha256((HERE / "package-lock.json").read_bytes()).hexdigest()[:16]
    return cache_root() / f"node-seg-readers-{digest}"


def install() -> Path:
    """``npm ci`` the pinned packages into :func:`install_dir` unless done; return it.

    Raises
    ------
    Unavailable
        ``node`` or ``npm`` is not on the PATH, or ``npm ci`` failed (no registry).
    """
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is not installed (apt-get install nodejs npm)")
    target = install_dir()
    done = target / ".installed"
    if not done.exists():
        target.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(HERE / name, target / name)
        command = ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"]
        try:
            proc = subprocess.run(
                command,
                cwd=target,
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"npm ci took over {INSTALL_TIMEOUT_S} s") from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-800:]
            raise Unavailable(f"npm ci failed (is the npm registry reachable?): {tail}")
        done.write_text("ok\n")
    # the script beside its node_modules, so that its imports resolve there
    shutil.copyfile(HERE / "read_seg.mjs", target / "read_seg.mjs")
    return target


def ct_metadata(sources: Sequence[Dataset]) -> list[dict[str, Any]]:
    """What a viewer's metadata provider knows of each CT instance, in stack order (the
    label map's slice order)."""
    return [
        {
            "sopInstanceUID": str(ds.SOPInstanceUID),
            "sopClassUID": str(ds.SOPClassUID),
            "seriesInstanceUID": str(ds.SeriesInstanceUID),
            "frameOfReferenceUID": str(ds.FrameOfReferenceUID),
            "rows": int(ds.Rows),
            "columns": int(ds.Columns),
            "imagePositionPatient": [float(v) for v in ds.ImagePositionPatient],
            "imageOrientationPatient": [float(v) for v in ds.ImageOrientationPatient],
            "pixelSpacing": [float(v) for v in ds.PixelSpacing],
            "sliceThickness": float(ds.get("SliceThickness") or 0.0),
        }
        for ds in sources
    ]


def read_seg(
    reader: str,
    seg: Path,
    ct: Sequence[Dataset],
    work: Path,
    *,
    labels: bool = False,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run ``reader`` (``"dcmjs"`` or ``"cornerstone"``) on the SEG file ``seg`` of the CT
    instances ``ct`` (stack order); its report, with ``"labels"``: the segment numbers it
    placed, ``(slices, rows, columns)`` uint16, when ``labels``.

    Raises
    ------
    Unavailable
        The readers cannot be installed.
    AssertionError
        The reader failed (its error in the message).
    """
    folder = install()
    work.mkdir(parents=True, exist_ok=True)
    ct_json = work / "ct.json"
    ct_json.write_text(json.dumps(ct_metadata(ct)))
    command = ["node", str(folder / "read_seg.mjs"), "--reader", reader]
    command += ["--seg", str(seg), "--ct", str(ct_json)]
    out = work / f"{reader}.raw"
    if labels:
        command += ["--labels", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{reader} failed on {seg.name}: {proc.stderr[-2000:]}"
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if labels:
        first = ct[0]
        shape = (len(ct), int(first.Rows), int(first.Columns))
        found: npt.NDArray[np.uint16] = np.fromfile(out, dtype="<u2").reshape(shape)
        report["labels"] = found
        out.unlink()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Install the readers; print where (exit 1 with the reason when that fails)."""
    del argv
    try:
        print(install())
    except Unavailable as exc:
        print(f"note: the Node.js SEG readers are not installed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
