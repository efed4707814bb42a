"""Statistics from an engine's per-label sums (segnode.engines.base.LabelSums), on the device and
off.

* :func:`segnode.node.results.statistics.statistics_from_sums` equals
  :func:`segnode.node.results.statistics.segment_statistics` (and the SR's rounded values) and fails
  with the same messages;
* the torch backend's :meth:`~segnode.engines.torch_backend.TorchEngine.segment_with_sums` runs on
  the CPU device here (a hand-written model instead of an ONNX conversion, so that onnx2torch and
  torchvision are not needed) and on CUDA where there is one (``gpu``);
* the worker uses an engine's sums when it gives them, logs one timing line per job, and
  prepares the SEG and SR before inference with ``[results] prepare = "before"``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from pydicom import dcmread

from segnode.engines.base import LabelSums, SumsEngine
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.node.config import DEFAULT_MODEL, ConfigError, from_dict
from segnode.node.errors import ResultError
from segnode.node.ingest.volume import Volume, assemble_from_datasets
from segnode.node.pipeline.worker import result_paths
from segnode.node.results.statistics import (
    SegmentStatistics,
    segment_statistics,
    statistics_from_sums,
)
from segnode.storage.ledger import Ledger
from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets, write_synthetic_series
from tests.test_worker import ingest, run_job, worker_on

MANIFEST = load_manifest(DEFAULT_MODEL)


def numpy_sums(labels: npt.NDArray[np.integer], hu: npt.NDArray[np.floating]) -> LabelSums:
    index = labels.reshape(-1).astype(np.intp)
    wide = hu.reshape(-1).astype(np.float64)
    return LabelSums(
        counts=np.bincount(index).astype(np.int64),
        sums=np.bincount(index, weights=wide),
        squares=np.bincount(index, weights=wide * wide),
    )


def sr_values(stats: list[SegmentStatistics]) -> list[tuple[Any, ...]]:
    """What the SR stores of each segment (6 decimals mL, 4 decimals HU)."""
    return [
        (s.segment_number, s.label.value, s.voxels, round(s.volume_ml, 6))
        + (round(s.mean_hu, 4), round(s.std_hu, 4))
        for s in stats
    ]


@pytest.fixture(scope="module")
def volume() -> Volume:
    base = assemble_from_datasets(
        synthetic_datasets(PhantomGeometry(rows=40, columns=36, slices=10), seed=5)
    )
    rng = np.random.default_rng(6)
    # Integer HU beyond the model's clipping range: the sums are of the HU, not the model input.
    hu = rng.integers(-2000, 4000, size=base.shape).astype(np.float32)
    return replace(base, hu=hu)


def fragmented(shape: tuple[int, ...], values: list[int], seed: int) -> npt.NDArray[np.uint8]:
    rng = np.random.default_rng(seed)
    return rng.choice(np.asarray(values, dtype=np.uint8), size=shape)


@pytest.mark.parametrize("values", [[0, 1, 2, 3, 4, 5], [0, 2, 5], [3], [0]])
def test_statistics_from_sums_equal_cpu_statistics(volume: Volume, values: list[int]) -> None:
    labels = fragmented(volume.shape, values, seed=len(values))
    expected = segment_statistics(volume, labels, MANIFEST)
    got = statistics_from_sums(volume, numpy_sums(labels, volume.hu), MANIFEST)
    assert got == expected
    assert sr_values(got) == sr_values(expected)


def test_statistics_from_short_sums(volume: Volume) -> None:
    """Sums that end at the largest label present (a bincount's length) are enough."""
    labels = fragmented(volume.shape, [0, 1, 2], seed=3)
    sums = numpy_sums(labels, volume.hu)
    assert len(sums.counts) == 3
    assert statistics_from_sums(volume, sums, MANIFEST) == segment_statistics(
        volume, labels, MANIFEST
    )


def _message(call: Any) -> str:
    with pytest.raises(ResultError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize(
    ("values", "labels_of"),
    [([0, 1, 7, 9], [1, 2, 3, 4, 5]), ([0, 1, 3], [1, 2, 4, 5])],
    ids=["above the largest label", "a gap in the labels"],
)
def test_unknown_values_fail_with_the_cpu_message(
    volume: Volume, values: list[int], labels_of: list[int]
) -> None:
    manifest = replace(MANIFEST, labels=tuple(s for s in MANIFEST.labels if s.value in labels_of))
    labels = fragmented(volume.shape, values, seed=9)
    sums = numpy_sums(labels, volume.hu)
    cpu = _message(lambda: segment_statistics(volume, labels, manifest))
    assert _message(lambda: statistics_from_sums(volume, sums, manifest)) == cpu
    assert "does not describe" in cpu


def test_sums_of_another_volume_fail(volume: Volume) -> None:
    labels = fragmented((2, *volume.shape[1:]), [0, 1], seed=1)
    message = _message(lambda: statistics_from_sums(volume, numpy_sums(labels, labels), MANIFEST))
    assert "voxels" in message


# --------------------------------------------------------------------- the torch backend


def _torch() -> Any:
    return pytest.importorskip("torch", reason="PyTorch not installed")


def _nearest_level(torch: Any, centres: list[float]) -> Any:
    """A stand-in model: logits ``-|x - centre|`` per class (a fragmented label map)."""
    levels = torch.tensor(centres, dtype=torch.float32).reshape(1, -1, 1, 1, 1)

    def predict(x: Any) -> Any:
        return -(x - levels.to(x.device)).abs()

    return predict


def torch_engine(manifest: ModelManifest, device: str) -> Any:
    """A :class:`TorchEngine` on ``device`` with a hand-written model in place of ``load``."""
    torch = _torch()
    from segnode.engines.torch_backend import TorchEngine

    engine = TorchEngine(device=device, precision="fp32")
    engine._torch, engine._dev, engine._dtype = torch, torch.device(device), torch.float32
    engine.manifest, engine._batch, engine.channels_last = manifest, 2, False
    engine._fn = _nearest_level(torch, [-900.0, -600.0, -100.0, 40.0, 300.0, 1500.0])
    return engine


def _check_engine_sums(volume: Volume, device: str) -> None:
    manifest = replace(
        MANIFEST, patch_size=(4, 16, 16), overlap=(0.5, 0.25, 0.25), output_kind="logits"
    )
    engine = torch_engine(manifest, device)
    assert isinstance(engine, SumsEngine)
    before = volume.hu.copy()
    labels, sums = engine.segment_with_sums(volume.hu)
    np.testing.assert_array_equal(labels, engine.segment(volume.hu))
    np.testing.assert_array_equal(volume.hu, before)  # the model's clipping went to a copy
    assert labels.dtype == np.uint8 and len(np.unique(labels)) == 6  # fragmented, every label
    assert sums.counts.dtype == np.int64 and sums.sums.dtype == np.float64
    expected = segment_statistics(volume, labels, manifest)
    got = statistics_from_sums(volume, sums, manifest)
    assert got == expected  # integer HU: float64 sums exact in any order
    assert sr_values(got) == sr_values(expected)


def test_torch_engine_sums_on_the_cpu_device(volume: Volume) -> None:
    _check_engine_sums(volume, "cpu")


@pytest.mark.gpu
def test_torch_engine_sums_on_cuda(volume: Volume) -> None:
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
    _check_engine_sums(volume, "cuda")


@pytest.mark.parametrize("values", [list(range(6)), list(range(118))], ids=["masked", "bincount"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_label_sums_equal_numpy(volume: Volume, values: list[int], device: str) -> None:
    """:meth:`TorchEngine.label_sums` (a trained model's statistics on the device): one
    masked reduction per value for a few labels, bincounts for TotalSegmentator's 117; both
    exact for integer HU."""
    torch = _torch()
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
    manifest = replace(MANIFEST, patch_size=(4, 16, 16), output_kind="logits")
    engine = torch_engine(manifest, device)
    labels = fragmented(volume.shape, values, seed=len(values))
    got = engine.label_sums(
        torch.from_numpy(labels).to(device), torch.from_numpy(volume.hu).to(device)
    )
    want = numpy_sums(labels, volume.hu)
    np.testing.assert_array_equal(got.counts[: len(want.counts)], want.counts)
    np.testing.assert_array_equal(got.sums[: len(want.sums)], want.sums)
    np.testing.assert_array_equal(got.squares[: len(want.squares)], want.squares)
    assert not got.counts[len(want.counts) :].any()


def test_segment_trained_with_sums_sums_where_the_engine_can(
    tmp_path: Path, volume: Volume
) -> None:
    """A trained model's job gets the sums from an engine that computes them on its device
    (:class:`~segnode.engines.base.DeviceSumsEngine`), over the HU it was given, and none
    from one that cannot (the worker then sums on the CPU)."""
    from segnode.engines.base import DeviceSumsEngine
    from segnode.engines.preprocess.orientation import Geometry
    from segnode.engines.trained import segment_trained, segment_trained_with_sums
    from tests.test_trained_runtime import geometry, phantom, write_trained

    class DeviceSums(OrtEngine):
        def label_sums(self, labels: Any, hu: Any) -> LabelSums:
            self.summed = True
            return numpy_sums(labels, hu)

    manifest = load_manifest(write_trained(tmp_path / "bands"))
    hu = phantom()
    geo: Geometry = geometry("feet-first", hu.shape)  # type: ignore[arg-type]
    plain = OrtEngine(threads=2)
    plain.load(manifest)
    summing = DeviceSums(threads=2)
    summing.load(manifest)
    assert isinstance(summing, DeviceSumsEngine) and not isinstance(plain, DeviceSumsEngine)
    labels, sums = segment_trained_with_sums(summing, manifest, hu, geo)
    np.testing.assert_array_equal(labels, segment_trained(plain, manifest, hu, geo))
    assert sums is not None and summing.summed
    want = numpy_sums(labels, hu)
    np.testing.assert_array_equal(sums.counts, want.counts)
    np.testing.assert_array_equal(sums.sums, want.sums)
    assert segment_trained_with_sums(plain, manifest, hu, geo)[1] is None


# --------------------------------------------------------------------------- the worker


class SummingEngine:
    """The ONNX Runtime engine, with the sums computed beside it (as a GPU engine would)."""

    name = "onnxruntime"

    def __init__(self, inner: OrtEngine) -> None:
        self.inner = inner
        self.calls = 0

    def load(self, manifest: ModelManifest) -> None:
        self.inner.load(manifest)

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        raise AssertionError("the worker should ask for the sums")

    def segment_with_sums(
        self, hu: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.uint8], LabelSums]:
        self.calls += 1
        labels = self.inner.segment(hu)
        return labels, numpy_sums(labels, hu)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def ort() -> OrtEngine:
    engine = OrtEngine()
    engine.load(MANIFEST)
    return engine


def _run_job(tmp_path: Path, engine: Any, **results: str) -> tuple[int, Ledger]:
    config = {"results": results} if results else None
    worker, ledger, spool = worker_on(tmp_path, engine, MANIFEST, config)
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=96, columns=96, slices=10), seed=41
    )
    jid, _ = run_job(worker, ledger, ingest(ledger, spool, files))
    worker.stop()
    view = ledger.job(jid)
    assert view is not None and view.state == "done", view
    return jid, ledger


def test_worker_uses_engine_sums(
    tmp_path: Path, ort: OrtEngine, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # Reference: the same job with the CPU statistics.
    ref_jid, _ = _run_job(tmp_path / "cpu", ort)

    def no_cpu_statistics(*args: object) -> None:
        raise AssertionError("statistics recomputed on the CPU")

    monkeypatch.setattr("segnode.node.pipeline.worker.segment_statistics", no_cpu_statistics)
    engine = SummingEngine(ort)
    with caplog.at_level(logging.INFO, logger="segnode.node.pipeline.worker"):
        jid, _ = _run_job(tmp_path / "sums", engine)
    assert engine.calls == 1
    # The UIDs differ between the two ledgers: compare the SRs' measured values.
    assert _sr_values(tmp_path / "sums", jid) == _sr_values(tmp_path / "cpu", ref_jid)
    line = next(r.getMessage() for r in caplog.records if "timing ms" in r.getMessage())
    assert "statistics" in line and "(engine sums)" in line and "(concurrent" in line
    for part in ("SEG encode", "check", "SR encode", "files", "ledger", "inference waited"):
        assert part in line


def _sr_values(data_dir: Path, jid: int) -> list[str]:
    (sr,) = (p for p in result_paths(data_dir, jid) if p.name.startswith("sr-"))
    values = [str(v) for v in _numeric_values(dcmread(sr))]
    assert values
    return values


def _numeric_values(ds: Any) -> list[Any]:
    out = []
    for item in ds.get("ContentSequence", []):
        if "MeasuredValueSequence" in item:
            out.append(item.MeasuredValueSequence[0].NumericValue)
        out += _numeric_values(item)
    return out


def test_worker_prepares_before_inference_on_request(
    tmp_path: Path, ort: OrtEngine, caplog: Any
) -> None:
    with caplog.at_level(logging.INFO, logger="segnode.node.pipeline.worker"):
        jid, _ = _run_job(tmp_path, ort, prepare="before")
    assert len(result_paths(tmp_path, jid)) == 2
    line = next(r.getMessage() for r in caplog.records if "timing ms" in r.getMessage())
    assert "(before" in line and "(CPU)" in line


def test_prepare_setting() -> None:
    assert from_dict({}).results.prepare == "concurrent"
    assert from_dict({"results": {"prepare": "before"}}).results.prepare == "before"
    with pytest.raises(ConfigError, match="results.prepare"):
        from_dict({"results": {"prepare": "after"}})
