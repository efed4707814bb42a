"""Calibrate a trained model for the CPU: INT8 from representative series or BF16, guarded.

``segnode model calibrate MANIFEST --series DIR ... | --spool DATA_DIR`` (:func:`calibrate`):

1. **Series.** Every folder given (a series' files, or a folder of series folders) and, with
   ``--spool``, every series the node has received (``<data_dir>/spool/<study>/<series>``)
   is read with the node's own volume assembly. The last ``held_out`` of them (at least one)
   are kept for the accuracy guard; the others are the calibration series. A model with no
   series to calibrate on is refused with what to give.
2. **Tiles** (INT8). Each calibration series goes through the model's own preprocessing and
   sliding window (:func:`segnode.engines.trained.segment_trained`, mirroring off) with a
   recording predictor; ``tiles_per_series`` tiles, spread evenly over the window's tiles,
   are the calibration inputs.
3. **Ranges** (INT8). ONNX Runtime's MinMax calibrator collects every tensor's range for
   each fold file. They are written as one calibration file beside the manifest
   (``<name>.calibration.json``: ONNX Runtime's calibration-cache form per fold), whose
   SHA-256 goes in the manifest.
4. **Quantization** (INT8). Static INT8 QDQ ONNX, per-channel INT8 weights and UINT8
   activations (``<fold>.int8.onnx``): ONNX Runtime's CPU provider runs it, OpenVINO runs
   it, and TensorRT's explicit-quantization INT8 path reads the same QDQ file. The first and
   last convolutions and any Softmax stay in float. Then the tool measures each convolution's
   quantization error on calibration tiles (the SQNR of its UINT8 input with its calibrated
   range and of its per-channel INT8 weights, :func:`layer_sensitivity`) and, where the
   guard fails, keeps the worst ones in float too, in rounds (2, 4, 8 ... more), until the
   guard passes or ``max_rounds`` is spent.
5. **Guard.** The candidate runs against FP32 (ONNX Runtime, the manifest's own files) on the
   held-out series, whole volumes on the model's full path. Dice per label over the
   held-out series (lowest over series, labels present in either map): below ``threshold``
   (default 0.99) for any label, nothing is written and :class:`GuardFailed` carries the
   Dice. BF16 has no ranges: its guard runs OpenVINO in BF16 against the same FP32
   reference, with the first convolutions in float32 (most of BF16's error enters with the
   input's rounding: see :mod:`segnode.engines.openvino_backend`): 1, then 3, then 6
   (:data:`BF16_FP32_LEADING`), until the guard passes; ``fp32_leading`` tries one count
   only (0: BF16 alone). The count written is ``calibration.fp32_leading_convolutions``.

On success the manifest gets ``"precision": "int8"`` (or ``"bf16"``) and a
``"calibration"`` section (the file and its SHA-256, the INT8 files, the layers kept in
float and why, the guard's Dice); engines that run INT8 files (``onnxruntime`` and
``openvino`` on the CPU) load them, and the SEG's and SR's algorithm identification say
which precision ran (:func:`segnode.engines.base.run_precision`). docs/import.md
("Calibrating for the CPU") is the user's guide.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import EngineError, HostArrays, PatchPredictor
from segnode.engines.engine_cache import atomic_move, atomic_write, sha256_bytes
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest

logger = logging.getLogger(__name__)

CALIBRATION_FORMAT = "segnode-calibration/1"
"""The ``"format"`` of a calibration file."""

DEFAULT_THRESHOLD = 0.99
"""Lowest Dice per label against FP32 that the guard accepts."""

ROUNDS = (0, 2, 4, 8, 16, 32)
"""Convolutions kept in float by measurement, round by round (beyond the first and last)."""


class CalibrationError(EngineError):
    """Calibration cannot run: no series, an unsupported model, a runtime missing."""


class GuardFailed(CalibrationError):
    """The calibrated model's Dice against FP32 fell below the threshold; nothing was written.

    Attributes
    ----------
    report
        What was measured (:class:`CalibrationReport`, ``written`` empty).
    """

    def __init__(self, message: str, report: CalibrationReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class Series:
    """One CT series for calibration or the guard: its folder, read again each time it is
    used, so that only one volume is in memory at a time."""

    name: str
    folder: Path

    def read(self) -> tuple[npt.NDArray[np.float32], Any]:
        """The HU volume and its geometry (the node's volume assembly)."""
        from segnode.engines.preprocess.orientation import Geometry
        from segnode.node.ingest.volume import assemble_volume

        volume = assemble_volume(_files(self.folder))
        return volume.hu, Geometry.from_volume(volume)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


@dataclass
class CalibrationReport:
    """What :func:`calibrate` did and measured.

    Attributes
    ----------
    precision
        ``"int8"`` or ``"bf16"``.
    calibration_series, held_out
        Names of the series used for ranges and for the guard.
    tiles
        Calibration tiles (INT8).
    kept_float
        ``(node, why)`` of every layer left in float (INT8).
    dice
        Lowest Dice per label name over the held-out series, of the model written (or of
        the last round tried).
    dice_min
        The lowest of :attr:`dice`.
    rounds
        Per round: layers kept by measurement and the lowest Dice.
    written
        Files written (empty when the guard failed).
    seconds
        Wall time per step.
    """

    precision: str
    threshold: float
    calibration_series: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)
    tiles: int = 0
    kept_float: list[tuple[str, str]] = field(default_factory=list)
    dice: dict[str, float] = field(default_factory=dict)
    dice_min: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """A human-readable summary (the command's output)."""
        out = [
            f"precision {self.precision}: {len(self.calibration_series)} calibration series, "
            f"{len(self.held_out)} held out ({', '.join(self.held_out)})",
        ]
        if self.precision == "int8":
            out.append(f"{self.tiles} calibration tiles; layers kept in float:")
            out += [f"  {node}: {why}" for node, why in self.kept_float]
        for r in self.rounds:
            kept = (
                f"the first {r['kept_by_measurement']} convolution(s) in float32"
                if self.precision == "bf16"
                else f"{r['kept_by_measurement']} more layer(s) in float"
            )
            out.append(f"round {r['round']}: {kept}, lowest Dice {r['dice_min']:.4f}")
        worst = sorted(self.dice.items(), key=lambda kv: kv[1])[:5]
        out.append(
            f"Dice per label against FP32 on the held-out series: lowest {self.dice_min:.4f} "
            f"(threshold {self.threshold}); lowest labels: "
            + ", ".join(f"{k} {v:.4f}" for k, v in worst)
        )
        out += [f"wrote {p}" for p in self.written]
        out.append(
            "time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items() if v >= 0.05)
        )
        return out


# ------------------------------------------------------------------------------ series


def series_folders(folders: Iterable[Path], spool: Path | None = None) -> list[Path]:
    """The series folders to read: each of ``folders`` that holds files (one series), or its
    sub-folders that do (a study or export folder); with ``spool`` (the node's data
    directory or its ``spool`` folder) every ``<study>/<series>`` folder there."""
    found: list[Path] = []
    for folder in folders:
        folder = Path(folder)
        if not folder.is_dir():
            raise CalibrationError(f"{folder}: not a folder of DICOM files")
        if any(p.is_file() for p in folder.iterdir()):
            found.append(folder)
        else:
            found += sorted(
                d for d in folder.rglob("*") if d.is_dir() and any(p.is_file() for p in d.iterdir())
            )
    if spool is not None:
        root = spool / "spool" if (spool / "spool").is_dir() else spool
        if not root.is_dir():
            raise CalibrationError(f"{spool}: no spool folder there (give the node's data_dir)")
        found += sorted(
            d
            for study in root.iterdir()
            if study.is_dir() and not study.name.startswith(".") and study.name != "incoming"
            for d in study.iterdir()
            if d.is_dir() and any(p.suffix == ".dcm" for p in d.iterdir())
        )
    unique: list[Path] = []
    for f in found:
        if f.resolve() not in {u.resolve() for u in unique}:
            unique.append(f)
    return unique


MAX_SERIES = 16
"""Series used at most (spread evenly over those found): each is read once per use."""


def read_series(
    folders: Sequence[Path], notes: list[str] | None = None, *, limit: int = MAX_SERIES
) -> list[Series]:
    """The folders of ``folders`` that hold one CT series (checked with the node's volume
    assembly; the others are skipped with a note), at most ``limit`` of them, spread evenly."""
    from segnode.node.ingest.volume import VolumeError, assemble_volume

    if len(folders) > limit:
        if notes is not None:
            notes.append(f"{len(folders)} series found: using {limit}, spread evenly")
        picks = sorted({int(round(i)) for i in np.linspace(0, len(folders) - 1, limit)})
        folders = [folders[i] for i in picks]
    out: list[Series] = []
    for folder in folders:
        try:
            assemble_volume(_files(folder))
        except VolumeError as exc:
            if notes is not None:
                notes.append(f"skipped {folder}: {exc}")
            continue
        out.append(Series(folder.name, folder))
    return out


# ------------------------------------------------------------------------------ tiles


class _Recorder(HostArrays):
    """A :class:`~segnode.engines.base.TrainedEngine` that records the tiles the window hands
    to the first fold and answers zeros (the labels are not used)."""

    name = "calibration-recorder"

    def __init__(self, manifest: ModelManifest) -> None:
        self.manifest = manifest
        self.tiles: list[npt.NDArray[np.float32]] = []

    def fold_predictors(self) -> list[PatchPredictor]:
        shape = (self.manifest.output_channels, *self.manifest.patch_size)

        def record(batch: Any) -> Any:
            tiles = np.asarray(batch, dtype=np.float32)
            self.tiles += [t.copy() for t in tiles]
            return np.zeros((len(tiles), *shape), dtype=np.float32)

        def zeros(batch: Any) -> Any:
            return np.zeros((len(batch), *shape), dtype=np.float32)

        return [record] + [zeros] * (len(self.manifest.model_files()) - 1)

    def window_batch(self) -> int:
        return 1


def collect_tiles(
    manifest: ModelManifest, series: Sequence[Series], per_series: int
) -> list[npt.NDArray[np.float32]]:
    """``per_series`` model-input tiles ``(1, *patch)`` of each series, spread evenly over the
    window's tiles, on the model's own preprocessing (mirroring off)."""
    from segnode.engines.trained import segment_trained

    contract = manifest.model_contract()
    plain = replace(manifest, contract=replace(contract, mirror_axes=()))
    chosen: list[npt.NDArray[np.float32]] = []
    for s in series:
        recorder = _Recorder(plain)
        segment_trained(recorder, plain, *s.read())
        n = len(recorder.tiles)
        picks = sorted({int(round(i)) for i in np.linspace(0, n - 1, min(per_series, n))})
        chosen += [recorder.tiles[i] for i in picks]
    return chosen


# ------------------------------------------------------------------------------ INT8


def _ort_quantization() -> Any:
    try:
        from onnxruntime import quantization
    except ImportError as exc:  # pragma: no cover - onnxruntime is a dependency
        raise CalibrationError(f"INT8 calibration needs onnxruntime's quantization: {exc}") from exc
    if "calibration_cache_path" not in quantization.quantize_static.__code__.co_varnames:
        import onnxruntime

        raise CalibrationError(
            f"INT8 calibration needs onnxruntime >= 1.23 (calibration caches); this is "
            f"{onnxruntime.__version__}: pip install -U onnxruntime"
        )
    return quantization


def _quantized_op_types() -> list[str]:
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))


class _Tiles:
    """ONNX Runtime's CalibrationDataReader over the tiles."""

    def __init__(self, input_name: str, tiles: Sequence[npt.NDArray[np.float32]]) -> None:
        self.input_name = input_name
        self.tiles = tiles
        self.index = 0

    def get_next(self) -> dict[str, npt.NDArray[np.float32]] | None:
        if self.index >= len(self.tiles):
            return None
        tile = self.tiles[self.index][None]
        self.index += 1
        return {self.input_name: tile}

    def __len__(self) -> int:
        return len(self.tiles)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.index = start_index


def tensor_ranges(
    onnx_path: Path, input_name: str, tiles: Sequence[npt.NDArray[np.float32]], work: Path
) -> dict[str, Any]:
    """ONNX Runtime's MinMax calibration of ``onnx_path`` on ``tiles``: its calibration cache
    (``TensorsData`` as a dict), tensor name -> range."""
    _ort_quantization()  # checks the version
    from onnxruntime.quantization.calibrate import (
        CalibrationDataReader,
        CalibrationMethod,
        create_calibrator,
        save_tensors_data,
    )

    class Reader(_Tiles, CalibrationDataReader):  # type: ignore[misc]
        pass

    calibrator = create_calibrator(
        onnx_path,
        _quantized_op_types(),
        augmented_model_path=str(work / f"{onnx_path.stem}.augmented.onnx"),
        calibrate_method=CalibrationMethod.MinMax,
    )
    # A tile per call: each call computes its ranges and merges them into the running ones,
    # so that one tile's intermediate tensors are held at a time (onnxruntime 1.32's
    # max_intermediate_outputs drops the batches it clears instead of merging them).
    for tile in tiles:
        calibrator.collect_data(Reader(input_name, [tile]))
    ranges = calibrator.compute_data()
    cache = work / f"{onnx_path.stem}.ranges.json"
    save_tensors_data(ranges, cache)
    doc: dict[str, Any] = json.loads(cache.read_text())
    return doc


def plain_weights(src: Path, dst: Path) -> None:
    """``src`` with every weight a float32 initializer: Identity and Cast nodes that only pass
    an initializer on (PyTorch's exporter writes Identity for shared parameters; a model
    stored in float16 has a Cast to float32 before each weight) folded into it. The
    quantizer quantizes an initializer as a weight (per channel, once) and anything else as an
    activation (per tensor, asymmetric, at every inference)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    inits = {i.name: i for i in model.graph.initializer}
    kept = []
    for node in model.graph.node:
        foldable = (
            node.op_type in ("Identity", "Cast")
            and len(node.input) == 1
            and len(node.output) == 1
            and node.input[0] in inits
        )
        to = next((a.i for a in node.attribute if a.name == "to"), onnx.TensorProto.FLOAT)
        if foldable and (node.op_type == "Identity" or to == onnx.TensorProto.FLOAT):
            value = numpy_helper.to_array(inits[node.input[0]])
            if node.op_type == "Cast":
                value = value.astype(np.float32)
            folded = numpy_helper.from_array(value, node.output[0])
            model.graph.initializer.append(folded)
            inits[folded.name] = folded
            continue
        kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    onnx.save(model, str(dst))


def conv_nodes(onnx_path: Path) -> list[Any]:
    """The model's Conv (and ConvTranspose) nodes in graph order."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]


def always_float(onnx_path: Path) -> list[tuple[str, str]]:
    """The nodes kept in float by rule: the first and last convolutions, any Softmax."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    kept: list[tuple[str, str]] = []
    if convs:
        kept.append((convs[0].name, "first convolution (the CT itself is its input)"))
        if len(convs) > 1:
            kept.append((convs[-1].name, "last convolution (the logits)"))
    kept += [(n.name, "softmax") for n in model.graph.node if n.op_type == "Softmax"]
    return kept


def _sqnr_db(x: npt.NDArray[np.float32], noise: npt.NDArray[np.float32]) -> float:
    signal = float(np.sum(np.square(x, dtype=np.float64)))
    err = float(np.sum(np.square(noise, dtype=np.float64)))
    if err <= 0.0:
        return 200.0
    if signal <= 0.0:
        return -200.0
    return 10.0 * float(np.log10(signal / err))


def _fake_quant_uint8(x: npt.NDArray[np.float32], lo: float, hi: float) -> npt.NDArray[np.float32]:
    """``x`` through ONNX Runtime's asymmetric UINT8 quantization with range ``[lo, hi]``
    (widened to hold 0)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255.0 or 1.0
    zero = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(x / scale) + zero, 0, 255)
    out: npt.NDArray[np.float32] = ((q - zero) * scale).astype(np.float32)
    return out


def _fake_quant_int8_per_channel(w: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Convolution weights through symmetric per-output-channel INT8 quantization."""
    flat = w.reshape(w.shape[0], -1)
    scale = np.abs(flat).max(axis=1, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    out: npt.NDArray[np.float32] = (
        (np.clip(np.round(flat / scale), -127, 127) * scale).reshape(w.shape).astype(np.float32)
    )
    return out


def layer_sensitivity(
    onnx_path: Path,
    input_name: str,
    ranges: dict[str, Any],
    tiles: Sequence[npt.NDArray[np.float32]],
) -> list[tuple[str, float]]:
    """Each convolution's quantization error, worst first: ``(node, SQNR in dB)`` of its
    UINT8 input (with the calibrated range, on ``tiles``) and its per-channel INT8 weights
    together (the noise powers add)."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    inits = {i.name: i for i in model.graph.initializer}
    convs = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
    wanted = sorted({n.input[0] for n in convs if n.input[0] != input_name})
    existing = {o.name for o in model.graph.output}
    for name in wanted:
        if name not in existing:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"]
    )
    outputs = [o.name for o in session.get_outputs()]
    signal: dict[str, float] = {}
    noise: dict[str, float] = {}
    table = ranges.get("data", ranges)
    for tile in tiles:
        values = dict(zip(outputs, session.run(None, {input_name: tile[None]}), strict=True))
        values[input_name] = tile[None]
        for node in convs:
            name = node.input[0]
            lo, hi = _range_of(table.get(name))
            x = values[name]
            fq = _fake_quant_uint8(x, lo, hi)
            signal[name] = signal.get(name, 0.0) + float(np.sum(np.square(x, dtype=np.float64)))
            noise[name] = noise.get(name, 0.0) + float(np.sum(np.square(x - fq, dtype=np.float64)))
        del values
    scores: list[tuple[str, float]] = []
    for node in convs:
        name = node.input[0]
        act = 10.0 * np.log10(signal[name] / noise[name]) if noise.get(name) else 200.0
        weight = 200.0
        if len(node.input) > 1 and node.input[1] in inits:
            w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
            weight = _sqnr_db(w, w - _fake_quant_int8_per_channel(w))
        combined = -10.0 * np.log10(10 ** (-act / 10.0) + 10 ** (-weight / 10.0))
        scores.append((node.name, round(float(combined), 2)))
    return sorted(scores, key=lambda kv: kv[1])


def _range_of(entry: Any) -> tuple[float, float]:
    """(min, max) of one tensor of ONNX Runtime's calibration cache."""
    if entry is None:
        return 0.0, 1.0

    def value(v: Any) -> float:
        if isinstance(v, dict):  # {"CLS": "numpy.array", "data": ..., "dtype": ...}
            v = v.get("data")
        return float(np.asarray(v, dtype=np.float64).reshape(-1)[0])

    if isinstance(entry, dict):
        return value(entry["lowest"]), value(entry["highest"])
    return value(entry[0]), value(entry[1])


def quantize_fold(
    onnx_path: Path,
    out: Path,
    ranges: dict[str, Any],
    exclude: Sequence[str],
    work: Path,
    *,
    symmetric: bool = False,
) -> None:
    """Static INT8 QDQ of one fold file with the calibrated ``ranges``: per-channel symmetric
    INT8 weights, ``exclude`` left in float; activations UINT8 with a zero point (ONNX
    Runtime's fastest form on x86: 2.2x FP32 a tile of the 31 M network, against 1.9x
    symmetric), or with ``symmetric`` INT8 with zero point 0 and float biases, the only form
    TensorRT's explicit quantization parses."""
    q = _ort_quantization()
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

    cache = work / f"{onnx_path.stem}.ranges.json"
    cache.write_text(json.dumps(ranges))
    logging.getLogger().disabled, was = True, logging.getLogger().disabled
    try:
        q.quantize_static(
            str(onnx_path),
            str(out),
            None,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(exclude),
            calibrate_method=CalibrationMethod.MinMax,
            calibration_cache_path=str(cache),
            extra_options={
                "ActivationSymmetric": symmetric,
                "WeightSymmetric": True,
                # TensorRT quantizes biases itself: it refuses INT32 ones
                "QuantizeBias": not symmetric,
            },
        )
    finally:
        logging.getLogger().disabled = was


# ------------------------------------------------------------------------------ guard


def dice_per_label(
    reference: Sequence[npt.NDArray[np.uint8]],
    candidate: Sequence[npt.NDArray[np.uint8]],
    manifest: ModelManifest,
) -> dict[str, float]:
    """Lowest Dice per label name over the series pairs, for labels present in either map
    of a series (a label in neither is not scored there)."""
    out: dict[str, float] = {}
    for ref, cand in zip(reference, candidate, strict=True):
        n = max(int(ref.max(initial=0)), int(cand.max(initial=0))) + 1
        both = np.bincount(ref[ref == cand].ravel(), minlength=n)
        in_ref = np.bincount(ref.ravel(), minlength=n)
        in_cand = np.bincount(cand.ravel(), minlength=n)
        for spec in manifest.labels:
            v = spec.value
            if v >= n or in_ref[v] + in_cand[v] == 0:
                continue
            d = 2.0 * float(both[v]) / float(in_ref[v] + in_cand[v])
            out[spec.name] = min(out.get(spec.name, 1.0), round(d, 5))
    return out


def _segment_all(engine: Any, manifest: ModelManifest, series: Sequence[Series]) -> list[Any]:
    from segnode.engines.trained import segment_trained

    return [segment_trained(engine, manifest, *s.read()) for s in series]


# ------------------------------------------------------------------------------ calibrate


def calibrate(
    manifest_path: Path,
    series: Sequence[Path] = (),
    *,
    spool: Path | None = None,
    precision: str = "int8",
    held_out: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    tiles_per_series: int = 8,
    max_rounds: int = 4,
    fp32_leading: int | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> CalibrationReport:
    """Calibrate the model of ``manifest_path`` (see the module docstring).

    Parameters
    ----------
    manifest_path
        A version-2 manifest (an imported nnU-Net model; not a composite).
    series, spool
        Representative CT series: folders, and the node's spool.
    precision
        ``"int8"`` or ``"bf16"``.
    held_out
        Series kept for the guard (default: a third, at least one).
    threshold
        Lowest Dice per label against FP32 that may be written.
    tiles_per_series
        Calibration tiles taken from each calibration series (INT8).
    max_rounds
        Rounds of keeping more measured layers in float before giving up (INT8).
    fp32_leading
        BF16: the one count of leading convolutions to run in float32 (default: 0, then
        :data:`BF16_FP32_LEADING` while the guard fails).
    threads
        CPU threads of the runtimes.

    Returns
    -------
    CalibrationReport

    Raises
    ------
    CalibrationError
        The model or the series do not allow calibration (the message says what to give).
    GuardFailed
        The best candidate's Dice stayed below ``threshold``; nothing was written.
    """
    say = progress or (lambda _: None)
    if precision not in ("int8", "bf16"):
        raise CalibrationError(f"precision must be int8 or bf16, got {precision!r}")
    if fp32_leading is not None and (precision != "bf16" or fp32_leading < 0):
        raise CalibrationError(
            f"fp32_leading {fp32_leading}: a count of 0 or more, for --precision bf16 only"
        )
    path = Path(manifest_path)
    if path.is_dir():
        path = path / f"{path.name}.json"
    manifest = load_manifest(path)
    if not manifest.is_trained or manifest.is_composite:
        raise CalibrationError(
            f"model {manifest.name!r}: calibration runs on one trained (version-2) model; "
            + (
                "calibrate each part's manifest of this composite"
                if manifest.is_composite
                else "this is a version-1 model"
            )
        )
    manifest = replace(manifest, precision="fp32")
    folders = series_folders(series, spool)
    if len(folders) < 2:
        raise CalibrationError(
            f"model {manifest.name!r} has no calibration data: give at least two representative "
            "CT series of the anatomy the model segments, as --series DICOM_FOLDER ... (one "
            "folder per series, or a folder of series folders) or --spool DATA_DIR (the series "
            f"the node has received); found {len(folders)}. One or more are held out to check "
            "the calibrated model against FP32."
        )
    notes: list[str] = []
    started = time.perf_counter()
    volumes = read_series(folders, notes)
    for note in notes:
        say(note)
    if len(volumes) < 2:
        raise CalibrationError(
            f"model {manifest.name!r}: {len(volumes)} of {len(folders)} folders are CT series "
            "(need two: one to calibrate on, one held out); " + "; ".join(notes)
        )
    keep = held_out if held_out is not None else max(1, len(volumes) // 3)
    if not 1 <= keep < len(volumes):
        raise CalibrationError(
            f"held_out must leave at least one of the {len(volumes)} series for calibration "
            f"and keep at least one, got {held_out}"
        )
    calib, guard = list(volumes[:-keep]), list(volumes[-keep:])
    report = CalibrationReport(
        precision=precision,
        threshold=threshold,
        calibration_series=[s.name for s in calib],
        held_out=[s.name for s in guard],
    )
    report.seconds["read"] = time.perf_counter() - started

    from segnode.engines.ort_backend import OrtEngine

    t0 = time.perf_counter()
    with OrtEngine(threads=threads) as fp32:
        fp32.load(manifest)
        reference = _segment_all(fp32, manifest, guard)
    report.seconds["fp32 reference"] = time.perf_counter() - t0
    say(
        f"FP32 reference on {len(guard)} held-out series "
        f"in {report.seconds['fp32 reference']:.1f} s"
    )
    if not any(int(r.max(initial=0)) > 0 for r in reference):
        raise CalibrationError(
            f"model {manifest.name!r} finds none of its labels in the held-out series "
            f"({', '.join(report.held_out)}): the guard cannot measure; give series that "
            "show the anatomy the model segments"
        )
    if precision == "bf16":
        counts = (fp32_leading,) if fp32_leading is not None else BF16_FP32_LEADING
        return _calibrate_bf16(path, manifest, guard, reference, report, counts, threads, say)
    return _calibrate_int8(
        path, manifest, calib, guard, reference, report, tiles_per_series, max_rounds, threads, say
    )


def _calibrate_bf16(
    path: Path,
    manifest: ModelManifest,
    guard: list[Series],
    reference: list[Any],
    report: CalibrationReport,
    counts: Sequence[int],
    threads: int | None,
    say: Callable[[str], None],
) -> CalibrationReport:
    """BF16 against the FP32 reference, with the first ``counts[i]`` convolutions in
    float32, in turn, until the guard passes."""
    from segnode.engines.openvino_backend import OpenVinoEngine

    t0 = time.perf_counter()
    for number, leading in enumerate(counts):
        with OpenVinoEngine(threads=threads, precision="bf16", fp32_leading=leading) as engine:
            engine.load(manifest)
            ran = engine.inference_precision
            if ran != "bf16":
                raise CalibrationError(
                    f"this CPU runs OpenVINO in {ran}, not bf16 (no AVX-512 BF16 or AMX): "
                    "calibrate on the machine that will run the model, or use --precision int8"
                )
            found = _segment_all(engine, manifest, guard)
        report.dice = dice_per_label(reference, found, manifest)
        report.dice_min = min(report.dice.values(), default=1.0)
        report.rounds.append(
            {"round": number, "kept_by_measurement": leading, "dice_min": report.dice_min}
        )
        say(
            f"bf16 with the first {leading} convolution(s) in float32: lowest Dice "
            f"{report.dice_min:.4f}"
        )
        if report.dice_min >= report.threshold:
            break
    report.seconds["bf16 guard"] = time.perf_counter() - t0
    if report.dice_min < report.threshold:
        raise GuardFailed(_failure(manifest, report), report)
    if leading:
        report.kept_float.append(
            (f"the first {leading} convolutions", "bf16 alone failed the guard (measured)")
        )
    section = _section(report, manifest) | {"fp32_leading_convolutions": leading}
    report.written = _write(path, {}, section, "bf16")
    return report


def _calibrate_int8(
    path: Path,
    manifest: ModelManifest,
    calib: list[Series],
    guard: list[Series],
    reference: list[Any],
    report: CalibrationReport,
    tiles_per_series: int,
    max_rounds: int,
    threads: int | None,
    say: Callable[[str], None],
) -> CalibrationReport:
    from segnode.engines.ort_backend import OrtEngine

    t0 = time.perf_counter()
    tiles = collect_tiles(manifest, calib, tiles_per_series)
    report.tiles = len(tiles)
    report.seconds["tiles"] = time.perf_counter() - t0
    say(f"{len(tiles)} calibration tiles from {len(calib)} series")
    work = Path(tempfile.mkdtemp(prefix=".calibrate-", dir=path.parent))
    try:
        originals = [Path(p) for p in manifest.fold_paths]
        folds = [work / f.name for f in originals]
        for f, plain in zip(originals, folds, strict=True):
            plain_weights(f, plain)
        t0 = time.perf_counter()
        ranges = {f.name: tensor_ranges(f, manifest.input_name, tiles, work) for f in folds}
        report.seconds["ranges"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rule = always_float(folds[0])
        ruled = {name for name, _ in rule}
        sample = tiles[:: max(1, len(tiles) // 2)][:2]
        scores = [
            s
            for s in layer_sensitivity(folds[0], manifest.input_name, ranges[folds[0].name], sample)
            if s[0] not in ruled
        ]
        report.seconds["sensitivity"] = time.perf_counter() - t0
        say("convolutions by quantization error (SQNR, dB), worst first: "
            + ", ".join(f"{n} {db}" for n, db in scores[:6]))  # fmt: skip
        best: tuple[float, dict[str, float], list[tuple[str, str]], list[Path]] | None = None
        for r, extra in enumerate(ROUNDS[: max(1, max_rounds)]):
            kept = rule + [(n, f"quantization error: SQNR {db} dB") for n, db in scores[:extra]]
            exclude = [n for n, _ in kept]
            t0 = time.perf_counter()
            outs = [work / f"{f.stem}.round{r}.int8.onnx" for f in folds]
            for f, out in zip(folds, outs, strict=True):
                quantize_fold(f, out, ranges[f.name], exclude, work)
            candidate = replace(manifest, precision="int8", int8_fold_paths=tuple(outs))
            with OrtEngine(threads=threads) as engine:
                engine.load(candidate)
                found = _segment_all(engine, candidate, guard)
            dice = dice_per_label(reference, found, manifest)
            low = min(dice.values(), default=1.0)
            report.rounds.append({"round": r, "kept_by_measurement": extra, "dice_min": low})
            report.seconds[f"round {r}"] = time.perf_counter() - t0
            say(f"round {r}: {len(kept)} layer(s) in float, lowest Dice {low:.4f}")
            if best is None or low > best[0]:
                best = (low, dice, kept, outs)
            if low >= report.threshold or extra >= len(scores):
                break
        assert best is not None
        report.dice_min, report.dice, report.kept_float, outs = best
        if report.dice_min < report.threshold:
            raise GuardFailed(_failure(manifest, report), report)
        calibration = {
            "format": CALIBRATION_FORMAT,
            "method": "MinMax",
            "model": manifest.name,
            "version": manifest.version,
            "tiles": len(tiles),
            "series": report.calibration_series,
            "folds": ranges,
        }
        final = {f"{f.stem}.int8.onnx": out for f, out in zip(folds, outs, strict=True)}
        section = _section(report, manifest)
        section["int8_folds"] = list(final)
        # The same ranges and layers in TensorRT's form, guarded the same way (on ONNX
        # Runtime: TensorRT itself may not run here); left out, with the reason, if it fails.
        t0 = time.perf_counter()
        exclude = [n for n, _ in report.kept_float]
        sym = [work / f"{f.stem}.int8.tensorrt.onnx" for f in folds]
        for f, out in zip(folds, sym, strict=True):
            quantize_fold(f, out, ranges[f.name], exclude, work, symmetric=True)
        candidate = replace(manifest, precision="int8", int8_fold_paths=tuple(sym))
        with OrtEngine(threads=threads) as engine:
            engine.load(candidate)
            low = min(
                dice_per_label(
                    reference, _segment_all(engine, candidate, guard), manifest
                ).values(),
                default=1.0,
            )
        report.seconds["tensorrt form"] = time.perf_counter() - t0
        section["guard"]["tensorrt_form_dice_min"] = low
        if low >= report.threshold:
            tensorrt = {
                f"{f.stem}.int8.tensorrt.onnx": out for f, out in zip(folds, sym, strict=True)
            }
            section["int8_tensorrt_folds"] = list(tensorrt)
            final.update(tensorrt)
        say(f"TensorRT form (symmetric INT8): lowest Dice {low:.4f}" + (
            "" if low >= report.threshold else " - below the threshold, not written"
        ))  # fmt: skip
        report.written = _write(path, final, section, "int8", calibration)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


BF16_FP32_LEADING = (1, 3, 6)
"""Leading convolutions run in float32, tried in turn until the guard passes. The first
convolution always: it costs about 3 % of the BF16 time and took the trained phantom model's
lowest Dice against ``nnUNetPredictor`` on a 300-slice CT from 0.9898 to 0.9947
(docs/performance.md); BF16 alone only with ``fp32_leading=0``."""


def _failure(manifest: ModelManifest, report: CalibrationReport) -> str:
    worst = sorted(report.dice.items(), key=lambda kv: kv[1])[:5]
    return (
        f"model {manifest.name!r}: {report.precision} fails the accuracy guard: lowest Dice per "
        f"label against FP32 {report.dice_min:.4f} < {report.threshold} on the held-out series "
        f"({', '.join(report.held_out)}; "
        + ", ".join(f"{k} {v:.4f}" for k, v in worst)
        + "); nothing was written"
    )


def _section(report: CalibrationReport, manifest: ModelManifest) -> dict[str, Any]:
    """The manifest's ``"calibration"`` section (without the file fields)."""
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "runtime": "onnxruntime" if report.precision == "int8" else "openvino",
        "calibration_series": report.calibration_series,
        "held_out_series": report.held_out,
        "kept_float": [{"node": n, "why": why} for n, why in report.kept_float],
        "guard": {
            "reference": "fp32 (onnxruntime, CPU)",
            "threshold": report.threshold,
            "dice_min": report.dice_min,
            "dice": report.dice,
        },
    }


def _write(
    path: Path,
    files: dict[str, Path],
    section: dict[str, Any],
    precision: str,
    calibration: dict[str, Any] | None = None,
) -> list[Path]:
    """Move the INT8 files and the calibration file beside the manifest, then replace the
    manifest (its precision and calibration section): each file atomically, the manifest
    last, so that a manifest never names a file that is not there."""
    written: list[Path] = []
    for name, tmp in files.items():
        target = path.parent / name
        atomic_move(tmp, target)
        written.append(target)
    if calibration is not None:
        target = path.with_name(f"{path.stem}.calibration.json")
        data = json.dumps(calibration, indent=1).encode()
        atomic_write(target, data)
        section = {
            "file": target.name,
            "sha256": sha256_bytes(data),
            **section,
        }
        written.append(target)
    doc = json.loads(path.read_text())
    doc["precision"] = precision
    doc["calibration"] = section
    atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode())
    written.append(path)
    load_manifest(path)  # the manifest written reads back
    return written


__all__ = [
    "CalibrationError",
    "CalibrationReport",
    "GuardFailed",
    "calibrate",
    "collect_tiles",
    "dice_per_label",
    "layer_sensitivity",
    "series_folders",
]
