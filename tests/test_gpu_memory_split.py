"""A volume that does not fit the GPU is split, not failed (issue 34).

:func:`segnode.engines.trained.segment_trained` catches the engine's out-of-GPU-memory error
(:class:`~segnode.engines.base.GpuMemoryError`) and tries again down
:func:`~segnode.engines.trained.memory_ladder`: fewer tiles per network call, then more
overlapping pieces of the model grid's slice axis (:meth:`ModelGrid.pieces`, TotalSegmentator's
thirds generalised). Here the GPU is ONNX Runtime on the CPU with a memory limit simulated
where the real one bites (the network's batch, the grid's extent); the real limit on a GPU is
``bench.total_gpu --gpu-limit`` (docs/performance.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from segnode.engines.base import EngineError, GpuMemoryError, out_of_gpu_memory
from segnode.engines.preprocess.pipeline import SPLIT_MARGIN, ModelGrid
from segnode.engines.trained import Attempt, memory_ladder

DATA = Path(__file__).resolve().parent / "data"


def grid(slices: int) -> ModelGrid:
    return ModelGrid(None, False, (slices, 4, 4), (slices, 4, 4), (1.5, 1.5, 1.5))


@pytest.mark.parametrize("slices", [60, 61, 62, 300, 601])
def test_three_pieces_are_totalsegmentators_thirds(slices: int) -> None:
    """For 3, the pieces are TotalSegmentator's ``do_triple_split`` slices, written out."""
    n, m = slices, SPLIT_MARGIN
    t = n // 3
    assert grid(n).pieces(3) == [
        (slice(0, t + m), slice(0, t), slice(0, t)),
        (slice(t + 1 - m, 2 * t + m), slice(m - 1, m - 1 + t), slice(t, 2 * t)),
        (slice(2 * t + 1 - m, n), slice(m - 1, m - 1 + n - 2 * t), slice(2 * t, n)),
    ]


@pytest.mark.parametrize(("slices", "count"), [(100, 1), (100, 2), (333, 4), (801, 8), (160, 8)])
def test_pieces_write_every_slice_once_from_inside_their_prediction(
    slices: int, count: int
) -> None:
    written = np.zeros(slices, dtype=int)
    for predicted, kept, target in grid(slices).pieces(count):
        assert 0 <= predicted.start < predicted.stop <= slices
        length = target.stop - target.start
        assert kept.stop - kept.start == length
        # the kept slices of the prediction are the written ones of the grid
        assert predicted.start + kept.start == target.start
        assert predicted.start + kept.stop <= predicted.stop
        written[target] += 1
    assert (written == 1).all()


def test_pieces_refuse_a_grid_too_short_for_their_margins() -> None:
    with pytest.raises(ValueError, match="too few to split in 8"):
        grid(100).pieces(8)


def test_the_ladder_halves_the_batch_then_splits_the_grid() -> None:
    assert list(memory_ladder(4, 400, split=True)) == [
        Attempt(4, 1),
        Attempt(2, 1),
        Attempt(1, 1),
        Attempt(1, 3),
        Attempt(1, 3, host_grid=True),
        Attempt(1, 6, host_grid=True),
    ]
    assert list(memory_ladder(3, 400, split=False)) == [Attempt(3, 1), Attempt(1, 1)]
    assert list(memory_ladder(1, 100, split=True)) == [Attempt(1, 1)]  # too short to split
    assert str(Attempt(1, 3)) == "batch 1, 3 pieces"
    assert str(Attempt(1, 6, True)) == "batch 1, 6 pieces, the grid made on the host"


class TightGpu:
    """An :class:`~segnode.engines.ort_backend.OrtEngine` behind a GPU's memory limit: its
    window batch is ``batch``, a network call of more than one tile runs out of memory, and
    the model grid does not fit in fewer than ``min_pieces`` pieces (the error raised where
    the torch engine's ``device_scope`` raises it)."""

    def __init__(self, engine: Any, batch: int, min_pieces: int) -> None:
        self.engine, self.batch, self.min_pieces = engine, batch, min_pieces
        self.name = "tight"
        self.released = 0
        self.calls: list[int] = []

    def fold_predictors(self) -> list[Any]:
        def tight(predict: Any) -> Any:
            def run(patches: Any) -> Any:
                self.calls.append(int(patches.shape[0]))
                if patches.shape[0] > 1:
                    raise MemoryError(f"{patches.shape[0]} tiles at once")
                return predict(patches)

            return run

        return [tight(p) for p in self.engine.fold_predictors()]

    def window_batch(self) -> int:
        return self.batch

    def device_scope(self) -> Any:
        return out_of_gpu_memory(MemoryError, "in the test")

    def to_device(self, hu: Any) -> Any:
        return self.engine.to_device(hu)

    def to_host(self, labels: Any) -> Any:
        return self.engine.to_host(labels)

    def release_memory(self) -> None:
        self.released += 1


@pytest.fixture(scope="module")
def composite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """TotalSegmentator's five ``total`` parts on the phantom, and TotalSegmentator's own
    labels with ``force_split=True`` (the split oracle's)."""
    import json

    split = DATA / "totalseg_phantom_split"
    fold = DATA / "nnunet_phantom" / "fold_0.onnx"
    if not ((split / "golden.npz").is_file() and fold.is_file()):
        pytest.skip("the split oracle is missing (python -m scripts.make_totalseg_split_oracle)")
    pytest.importorskip("onnx")
    from scripts.make_totalseg_oracle import rebuild_composite
    from segnode.engines.manifest_parse import load_manifest
    from segnode.engines.ort_backend import OrtEngine

    manifest = load_manifest(rebuild_composite(split, tmp_path_factory.mktemp("tight"), fold))
    engine = OrtEngine()
    engine.load(manifest)
    with np.load(split / "golden.npz") as z:
        names = {int(k): str(v) for k, v in json.loads(str(z["names"])).items()}
        maps = {k.split("__")[0]: z[k] for k in z.files if k.endswith("__totalsegmentator")}
    return manifest, engine, (maps, names)


@pytest.mark.slow
def test_a_volume_too_large_for_the_gpu_is_split_as_totalsegmentator_splits(
    tmp_path: Path,
    composite: tuple[Any, Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The 800-slice feet-first phantom on a GPU where neither a batch of tiles nor the whole
    grid fits: the job goes down the ladder to one tile per call in 3 pieces, hands the
    cached memory back between attempts, and gives TotalSegmentator's own answer for a
    volume it splits in thirds (``force_split=True``, Dice >= 0.999 per structure)."""
    from scripts.make_totalseg_oracle import compare, oracle_series
    from scripts.nnunet_phantom import write_dicom_case
    from segnode.engines import trained
    from segnode.engines.preprocess.orientation import Geometry
    from segnode.node.ingest.volume import assemble_volume

    manifest, engine, (maps, their_names) = composite
    case = {c.name: c for c in oracle_series()}["long_ffs"]
    volume = assemble_volume(write_dicom_case(case, tmp_path / "long", seed=11))
    geometry = Geometry.from_volume(volume)

    tight = TightGpu(engine, batch=4, min_pieces=3)
    real = trained._run_on_grid
    pieces_tried = []

    def grid_run(*args: Any) -> Any:
        attempt = args[5]
        pieces_tried.append(attempt.pieces)
        if attempt.batch == 1 and attempt.pieces < tight.min_pieces:
            with out_of_gpu_memory(MemoryError, "in the test"):
                raise MemoryError(f"a grid in {attempt.pieces} piece(s)")
        return real(*args)

    monkeypatch.setattr(trained, "_run_on_grid", grid_run)
    with caplog.at_level(logging.WARNING, logger="segnode.engines.trained"):
        split = trained.segment_trained(tight, manifest, volume.hu, geometry)
    assert pieces_tried == [1, 1, 1, 3]
    assert tight.released == 3
    tried = [r.getMessage() for r in caplog.records if "out of GPU memory" in r.getMessage()]
    assert len(tried) == 3 and "trying batch 1, 3 pieces" in tried[-1], tried
    assert tight.calls[:2] == [4, 2]  # the batches that ran out, then one tile per call
    assert set(tight.calls[2:]) == {1}
    names = {label.value: label.name for label in manifest.labels}
    scores = compare(split, names, maps["long_ffs"], their_names)
    assert min(scores.values()) >= 0.999, scores


def test_a_volume_that_never_fits_fails_with_what_was_tried(
    composite: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from segnode.engines import trained
    from segnode.engines.preprocess.orientation import Geometry

    manifest, engine, _ = composite
    hu = np.full((240, 64, 64), -1000.0, dtype=np.float32)
    geometry = Geometry.from_image_plane(
        (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), [(0.0, 0.0, 1.5 * k) for k in range(240)], (1.5, 1.5)
    )

    def never(*args: Any) -> Any:
        with out_of_gpu_memory(MemoryError, "in the test"):
            raise MemoryError("no room")

    monkeypatch.setattr(trained, "_run_on_grid", never)
    with pytest.raises(GpuMemoryError, match="does not fit the GPU, tried batch 1, 1 piece") as e:
        trained.segment_trained(TightGpu(engine, 1, 99), manifest, hu, geometry)
    assert "batch 1, 3 pieces, the grid made on the host" in str(e.value)
    assert isinstance(e.value, EngineError)


def test_the_grid_made_on_the_host_gives_the_same_labels(
    tmp_path: Path, composite: tuple[Any, Any, Any]
) -> None:
    """The ladder's last rungs make the model grid on the host and take the merged labels
    back there: the same labels as the grid made where the networks run (here both are the
    host: ONNX Runtime; on the GPU, ``bench.total_gpu --gpu-limit``)."""
    from scripts.make_totalseg_oracle import oracle_series
    from scripts.nnunet_phantom import write_dicom_case
    from segnode.engines import trained
    from segnode.engines.preprocess.orientation import Geometry
    from segnode.node.ingest.volume import assemble_volume

    manifest, engine, _ = composite
    case = {c.name: c for c in oracle_series()}["native_ffs"]
    volume = assemble_volume(write_dicom_case(case, tmp_path / "ffs", seed=3))
    geometry = Geometry.from_volume(volume)
    units = trained._grid_units(manifest)
    assert units is not None
    runs = [
        trained._run_on_grid(
            manifest, units, volume.hu, geometry, engine.fold_predictors(), a, True, engine
        )
        for a in (Attempt(1, 3), Attempt(1, 3, host_grid=True))
    ]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[1].shape == volume.hu.shape and runs[1].dtype == np.uint8
