"""A preview PNG of each result: three orthogonal slices of the CT with the segments over it.

The :class:`Previewer` renders, on its own low-priority thread, after a job's SEG and SR are
written (``Worker.on_encoded``), so the worker and the outbox never wait for it. Each
preview is read back from what the node sends, not from the worker's memory:

* the CT from the spooled instances (:func:`segnode.node.ingest.volume.assemble_volume`),
* the label map from the written SEG (highdicom, by source instance or frame),
* the segment colours from the SEG's Recommended Display CIELab Value (PS3.3 C.8.20.2),
* the volumes from the SR's TID 1411 measurement groups (PS3.16), for the legend.

The slices pass through the centre of the segmented voxels (the middle of the volume when
nothing is segmented); soft-tissue window (W 400, L 40); superior at the top of the coronal
and sagittal views. The file is ``<data_dir>/results/<job id>/preview.png``, written
atomically, with Pillow (a dependency of highdicom).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pydicom
from pydicom.dataset import Dataset

from segnode.node.ingest.volume import Volume, assemble_volume

if TYPE_CHECKING:
    from segnode.storage.ledger import Ledger

log = logging.getLogger(__name__)

PANEL = 256  # pixels: the longer side of each of the three views
WINDOW = (40.0, 400.0)  # level, width (HU)
ALPHA = 0.45
MAX_VOXELS = 2**28  # larger volumes get no preview (1 GiB of float32 while rendering)
_VOLUME = ("118565006", "SCT")  # Volume
_GROUP = ("125007", "DCM")  # Measurement Group
_SEGMENT = ("121191", "DCM")  # Referenced Segment


def preview_path(data_dir: Path, job_id: int) -> Path:
    """Where the preview of job ``job_id`` lies."""
    return data_dir / "results" / str(job_id) / "preview.png"


@dataclass(frozen=True)
class SegmentInfo:
    """One segment of the legend."""

    number: int
    label: str
    rgb: tuple[int, int, int]
    volume_ml: float | None


def segment_infos(seg: Dataset, sr: Dataset | None) -> list[SegmentInfo]:
    """The SEG's segments (number, label, display colour) with their SR volumes."""
    import highdicom as hd

    volumes = sr_volumes(sr) if sr is not None else {}
    out = []
    for item in seg.SegmentSequence:
        number = int(item.SegmentNumber)
        if number == 0:  # LABELMAP background
            continue
        lab = item.get("RecommendedDisplayCIELabValue")
        rgb = (255, 255, 0)
        if lab is not None:
            rgb = hd.color.CIELabColor.from_dicom_value([int(v) for v in lab]).to_rgb(clip=True)
        out.append(SegmentInfo(number, str(item.SegmentLabel), rgb, volumes.get(number)))
    return out


def _code(item: Dataset) -> tuple[str, str] | None:
    seq = item.get("ConceptNameCodeSequence")
    if not seq:
        return None
    return str(seq[0].CodeValue), str(seq[0].CodingSchemeDesignator)


def sr_volumes(sr: Dataset) -> dict[int, float]:
    """Segment number -> volume (mL) from a TID 1500 report's measurement groups."""
    found: dict[int, float] = {}

    def walk(items: Any) -> None:
        for item in items or ():
            if _code(item) == _GROUP:
                number: int | None = None
                volume: float | None = None
                for child in item.get("ContentSequence", ()):
                    code = _code(child)
                    if code == _SEGMENT and child.get("ReferencedSOPSequence"):
                        ref = child.ReferencedSOPSequence[0]
                        if "ReferencedSegmentNumber" in ref:
                            number = int(ref.ReferencedSegmentNumber)
                    elif code == _VOLUME and child.get("MeasuredValueSequence"):
                        volume = float(child.MeasuredValueSequence[0].NumericValue)
                if number is not None and volume is not None:
                    found[number] = volume
            else:
                walk(item.get("ContentSequence"))

    walk(sr.get("ContentSequence"))
    return found


def label_map(seg_path: Path, volume: Volume) -> npt.NDArray[np.integer]:
    """The SEG's segment numbers on the volume's grid ``(z, y, x)``."""
    import highdicom as hd

    from segnode.node.results.build import seg_label_map

    return seg_label_map(hd.seg.segread(seg_path), volume)


def _resample(img: npt.NDArray[Any], pitch: tuple[float, float]) -> npt.NDArray[Any]:
    """Nearest-neighbour resampling of ``img`` (pixel pitch ``(dy, dx)`` mm) to square
    pixels, the longer side :data:`PANEL` pixels."""
    h_mm, w_mm = img.shape[0] * pitch[0], img.shape[1] * pitch[1]
    scale = PANEL / max(h_mm, w_mm)
    h, w = max(1, round(h_mm * scale)), max(1, round(w_mm * scale))
    rows = np.minimum((np.arange(h) + 0.5) / scale / pitch[0], img.shape[0] - 1).astype(np.intp)
    cols = np.minimum((np.arange(w) + 0.5) / scale / pitch[1], img.shape[1] - 1).astype(np.intp)
    return img[np.ix_(rows, cols)]


def _blend(
    hu: npt.NDArray[np.float32],
    labels: npt.NDArray[np.integer],
    colours: Mapping[int, tuple[int, int, int]],
) -> npt.NDArray[np.uint8]:
    level, width = WINDOW
    grey = np.clip((hu - (level - width / 2)) / width, 0.0, 1.0) * 255.0
    rgb = np.repeat(grey[..., None], 3, axis=2)
    for number, colour in colours.items():
        mask = labels == number
        if mask.any():
            rgb[mask] = (1 - ALPHA) * rgb[mask] + ALPHA * np.asarray(colour, dtype=np.float32)
    return rgb.astype(np.uint8)


def render(volume: Volume, labels: npt.NDArray[np.integer], segments: list[SegmentInfo]) -> Any:
    """The preview as a Pillow image: axial, coronal and sagittal views and a legend."""
    from PIL import Image, ImageDraw, ImageFont

    if labels.shape != volume.hu.shape:
        raise ValueError(f"label map {labels.shape} does not match the CT {volume.hu.shape}")
    hu = volume.hu
    found = np.argwhere(labels > 0)
    centre = found.mean(axis=0) if len(found) else np.asarray(hu.shape) / 2
    kc, ic, jc = (int(min(max(c, 0), n - 1)) for c, n in zip(centre, hu.shape, strict=True))
    dz, dy, dx = (abs(float(s)) for s in volume.spacing)
    up = -1 if volume.normal[2] > 0 else 1  # superior at the top (LPS: +z is superior)
    views = [
        (hu[kc], labels[kc], (dy, dx), "axial"),
        (hu[::up, ic, :], labels[::up, ic, :], (dz, dx), "coronal"),
        (hu[::up, :, jc], labels[::up, :, jc], (dz, dy), "sagittal"),
    ]
    colours = {s.number: s.rgb for s in segments}
    panels = [
        _blend(_resample(h, pitch), _resample(lab, pitch), colours) for h, lab, pitch, _ in views
    ]
    try:
        font: Any = ImageFont.load_default(size=13)
    except TypeError:  # Pillow < 10.1: the bitmap font only
        font = ImageFont.load_default()
    gap, line = 8, 18
    width = sum(p.shape[1] for p in panels) + gap * (len(panels) + 1)
    height = PANEL + 2 * gap + line + line * max(1, len(segments)) + gap
    image = Image.new("RGB", (width, height), (16, 16, 16))
    draw = ImageDraw.Draw(image)
    x = gap
    for panel, (*_, name) in zip(panels, views, strict=True):
        image.paste(Image.fromarray(panel, "RGB"), (x, gap + (PANEL - panel.shape[0]) // 2))
        draw.text((x + 4, gap + 2), name, fill=(230, 230, 230), font=font)
        x += panel.shape[1] + gap
    y = PANEL + 2 * gap
    draw.text((gap, y), "segment / volume (SR)", fill=(180, 180, 180), font=font)
    for s in segments:
        y += line
        draw.rectangle((gap, y + 2, gap + 12, y + 14), fill=s.rgb)
        volume_text = "-" if s.volume_ml is None else f"{s.volume_ml:.1f} mL"
        draw.text((gap + 20, y), f"{s.label}: {volume_text}", fill=(230, 230, 230), font=font)
    if not segments:
        draw.text((gap, y + line), "no segment", fill=(230, 230, 230), font=font)
    return image


def write_preview(
    data_dir: Path, job_id: int, ct_paths: list[Path], seg_path: Path, sr_path: Path | None
) -> Path:
    """Render and write the preview of one job; return its path.

    Raises
    ------
    ValueError, OSError, segnode.node.ingest.volume.VolumeError
        If the CT or the results cannot be read or do not fit together.
    """
    volume = assemble_volume(ct_paths)
    seg = pydicom.dcmread(seg_path, stop_before_pixels=True)
    sr = pydicom.dcmread(sr_path) if sr_path is not None else None
    image = render(volume, label_map(seg_path, volume), segment_infos(seg, sr))
    out = preview_path(data_dir, job_id)
    tmp = out.with_name(f".{out.name}.tmp")
    image.save(tmp, format="PNG", optimize=False)
    os.replace(tmp, out)
    return out


class Previewer:
    """Renders previews on one background thread, in the order the jobs were encoded.

    Parameters
    ----------
    data_dir
        The node's data directory (results under ``results/<job id>/``).
    ledger
        Where a job's series, result files and CT instances are found.
    """

    def __init__(self, data_dir: Path, ledger: Ledger) -> None:
        self.data_dir = data_dir
        self.ledger = ledger
        self._queue: queue.Queue[int | None] = queue.Queue(maxsize=256)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._run, name="segnode-preview", daemon=True)
        self._thread.start()

    def submit(self, job_id: int) -> None:
        """Queue the preview of ``job_id`` (dropped, with a log line, when 256 wait)."""
        try:
            self._queue.put_nowait(job_id)
        except queue.Full:
            log.warning("job %d: preview queue full; no preview", job_id)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the preview in progress, drop the others, stop the thread."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def missing(self, recent: int = 20) -> list[int]:
        """Of the ``recent`` latest jobs, those with results on disk and no preview (encoded
        before a restart, or while ``[web]`` was off), oldest first."""
        out = []
        for view in self.ledger.jobs(recent):
            if view.state in ("encoded", "sent", "done") and view.seg_sop_uid:
                folder = self.data_dir / "results" / str(view.id)
                seg = folder / f"seg-{view.seg_sop_uid}.dcm"
                if seg.is_file() and not preview_path(self.data_dir, view.id).is_file():
                    out.append(view.id)
        return sorted(out)

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: per-thread niceness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        try:
            for missing in self.missing():
                self.submit(missing)
        except Exception as exc:  # the ledger is closing: nothing to catch up
            log.warning("previews: cannot list the jobs without one: %s", exc)
        while (job_id := self._queue.get()) is not None:
            if preview_path(self.data_dir, job_id).is_file():
                continue  # a retried job: its results (same UIDs) were drawn already
            try:
                self.render_job(job_id)
            except Exception as exc:  # a preview must never stop the node
                log.warning("job %d: no preview: %s: %s", job_id, type(exc).__name__, exc)

    def render_job(self, job_id: int) -> Path | None:
        """Render the preview of one encoded job now; None when it has no SEG on disk."""
        view = self.ledger.job(job_id)
        if view is None or not view.seg_sop_uid:
            return None
        folder = self.data_dir / "results" / str(job_id)
        seg_path = folder / f"seg-{view.seg_sop_uid}.dcm"
        if not seg_path.is_file():
            return None
        sr_path = folder / f"sr-{view.sr_sop_uid}.dcm"
        ct = self.ledger.instance_paths(view.series_instance_uid)
        if not ct:
            return None
        head = pydicom.dcmread(ct[0], stop_before_pixels=True)
        voxels = int(head.get("Rows", 0)) * int(head.get("Columns", 0))
        voxels *= max(len(ct), int(head.get("NumberOfFrames", 1) or 1))
        if voxels > MAX_VOXELS:
            log.info("job %d: no preview (%d voxels, more than %d)", job_id, voxels, MAX_VOXELS)
            return None
        path = write_preview(
            self.data_dir, job_id, ct, seg_path, sr_path if sr_path.is_file() else None
        )
        log.info("job %d: preview written", job_id)
        return path
