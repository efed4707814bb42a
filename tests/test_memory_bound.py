"""Memory of a trained model with many labels (issue 37): bounded by the volume, not by labels x
voxels.

* A model with 120 output channels (a 1x1x1 convolution made here with ``onnx.helper``: channel
  ``c`` wins where the normalised intensity is nearest its centre) runs on a CT volume through
  :func:`segnode.engines.trained.segment_trained` on ONNX Runtime, in a subprocess whose peak
  resident set (``VmHWM``, reset after loading) must stay under a bound computed from the
  volume's voxels; the logits of every label at the source resolution would be 8x that bound.
  Both ways back: nnU-Net's (logits resampled at order 1) and TotalSegmentator's (labels at
  order 0).
* The streamed export (:func:`segnode.engines.preprocess.export.labels_from_slabs`) gives the
  labels of the whole-array resampling and arg-max, slice chunks and channel groups forced
  small.
* The streamed sliding window gives the whole-image logits bit for bit, with an accumulator
  about one patch deep.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from segnode.engines import nnunet_window
from segnode.engines.nnunet_window import WindowSettings, sliding_window_logits
from segnode.engines.preprocess import export
from segnode.engines.preprocess.export import Decision, labels_from_slabs
from segnode.engines.preprocess.resampling import resample

onnx = pytest.importorskip("onnx")

CHANNELS = 120
PATCH = (32, 32, 32)
SHAPE = (96, 128, 128)  # source (z, y, x): 0.8 mm pixels, 1.5 mm slices; model grid 3 mm
INTENSITY = {"mean": 0.0, "std": 400.0, "percentile_00_5": -1000.0, "percentile_99_5": 1000.0}


def write_many_labels(folder: Path, *, scheme: str) -> Path:
    """A 120-channel model and its manifest: logit ``s_c x - s_c^2 / 2`` of the normalised
    intensity ``x``, largest for the centre ``s_c`` nearest ``x``."""
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    centres = np.linspace(-2.5, 2.5, CHANNELS).astype(np.float32)
    weight = numpy_helper.from_array(centres.reshape(CHANNELS, 1, 1, 1, 1), "w")
    bias = numpy_helper.from_array(-0.5 * centres**2, "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "w", "b"], ["logits"], kernel_shape=[1, 1, 1])],
        "many_labels",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, *PATCH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CHANNELS, *PATCH])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fold_0.onnx").write_bytes(model.SerializeToString())
    totalseg = scheme == "totalsegmentator"
    resampling: dict[str, Any] = {
        "data_order": 1 if totalseg else 3,
        "logits_order": 0 if totalseg else 1,
    }
    if totalseg:
        resampling["scheme"] = "totalsegmentator"
    raw = {
        "manifest_version": 2,
        "name": "many_labels",
        "version": "1.0.0",
        "folds": ["fold_0.onnx"],
        "input_name": "input",
        "output_name": "logits",
        "output_kind": "logits",
        "patch_size": list(PATCH),
        "overlap": 0.5,
        "mirror_axes": [],
        "batch": {"min": 1, "opt": 2, "max": 4},
        "geometry": {"spacing": [3.0, 3.0, 3.0], "orientation": "SPL"},
        "preprocessing": {"crop_to_nonzero": True, "normalization": "ct", "intensity": INTENSITY},
        "resampling": resampling,
        "labels": [
            {
                "value": k,
                "name": f"structure {k}",
                "category": ["85756007", "SCT", "Tissue"],
                "type": ["85756007", "SCT", "Tissue"],
                "color": [k, 255 - k, 128],
            }
            for k in range(1, CHANNELS)
        ],
    }
    path = folder / "many_labels.json"
    path.write_text(json.dumps(raw))
    return path


CHILD = """
import json, sys
import numpy as np
from segnode.engines.base import create_engine
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.preprocess.orientation import Geometry
from segnode.engines.trained import segment_trained

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

manifest = load_manifest(sys.argv[1])
engine = create_engine("onnxruntime")
engine.load(manifest)
z, y, x = (int(n) for n in sys.argv[2:5])
rng = np.random.default_rng(0)
ramp = np.linspace(-1000.0, 1000.0, x, dtype=np.float32)
hu = np.broadcast_to(ramp, (z, y, x)) + rng.normal(0.0, 20.0, (z, y, x)).astype(np.float32)
hu = np.ascontiguousarray(hu, dtype=np.float32)
positions = [(0.0, 0.0, -1.5 * k) for k in range(z)]
geometry = Geometry.from_image_plane((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), positions, (0.8, 0.8))
labels = np.zeros(1, np.uint8)
segment_trained(engine, manifest, hu[:, :40, :40].copy(), geometry)  # warm the session
baseline = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
labels = segment_trained(engine, manifest, hu, geometry)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM:"),
                  "labels": int(np.unique(labels).size)}))
"""


def _limit_address_space() -> None:
    """The child's address space capped, so that a regression fails here and not the host."""
    resource.setrlimit(resource.RLIMIT_AS, (4 * 1024**3, 4 * 1024**3))


@pytest.mark.parametrize("scheme", ["nnunet", "totalsegmentator"])
def test_many_labels_peak_memory_is_bounded_by_the_volume(tmp_path: Path, scheme: str) -> None:
    path = write_many_labels(tmp_path / scheme, scheme=scheme)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), *map(str, SHAPE)],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_limit_address_space,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    voxels = SHAPE[0] * SHAPE[1] * SHAPE[2]
    # 64 bytes a source voxel (the HU, its float64 resampling, the labels) and 256 MiB of
    # slabs and tiles; the logits of every label at the source resolution in float32 alone
    # are 480 bytes a voxel
    bound = 64 * voxels + 256 * 1024**2
    grown = found["peak"] - found["baseline"]
    print(f"{scheme}: peak grew by {grown / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    assert grown <= bound, f"peak grew by {grown / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
    assert found["labels"] >= 60  # the many labels are really there


@pytest.mark.parametrize(
    ("separate_axis", "order", "order_z"),
    [(None, 1, 0), (0, 1, 0), (0, 1, 1), (2, 1, 0), (None, 0, 0), (0, 0, 1)],
)
@pytest.mark.parametrize("regions", [False, True])
def test_streamed_export_equals_the_whole_resampling(
    monkeypatch: pytest.MonkeyPatch,
    separate_axis: int | None,
    order: int,
    order_z: int,
    regions: bool,
) -> None:
    monkeypatch.setattr(export, "_CHUNK_BYTES", 4096)  # one slice, a few channels at a time
    rng = np.random.default_rng(7)
    scores = rng.normal(size=(9, 13, 11, 10)).astype(np.float32)
    new_shape = (31, 7, 23)
    decide = Decision((1, 2, 3, 4, 5, 6, 7, 8, 9), 0.3) if regions else Decision()
    whole = decide(
        resample(scores, new_shape, order=order, separate_axis=separate_axis, order_z=order_z)
    )
    cuts = [0, 1, 2, 6, 7, 13]
    slabs = [(a, b, scores[:, a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    streamed = labels_from_slabs(
        slabs,
        decide,
        model_shape=(13, 11, 10),
        new_shape=new_shape,
        order=order,
        separate_axis=separate_axis,
        order_z=order_z,
        precise=True,
    )
    np.testing.assert_array_equal(streamed, whole)


def test_streamed_export_refuses_slabs_out_of_order() -> None:
    scores = np.zeros((3, 4, 5, 5), np.float32)
    with pytest.raises(ValueError, match="from slice 0"):
        labels_from_slabs(
            [(1, 4, scores[:, 1:])],
            Decision(),
            model_shape=(4, 5, 5),
            new_shape=(8, 5, 5),
            order=1,
            separate_axis=None,
            order_z=0,
            precise=True,
        )


def test_sliding_window_slabs_match_the_whole_image_in_a_fraction_of_its_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    centres = np.linspace(-2.0, 2.0, 6, dtype=np.float32).reshape(1, 6, 1, 1, 1)

    def predictor(batch: Any) -> Any:
        return np.sin(batch * centres + centres).astype(np.float32)

    image = np.random.default_rng(1).normal(size=(960, 20, 18)).astype(np.float32)
    settings = WindowSettings(patch_size=(8, 16, 16), tile_step_size=0.5, batch_size=3)
    whole = sliding_window_logits(image, [predictor], settings)
    monkeypatch.setattr(nnunet_window, "_SLAB_BYTES", 1)  # a slice at a time
    tracemalloc.start()
    try:
        got = 0
        for start, stop, slab in nnunet_window.sliding_window_slabs(image, [predictor], settings):
            assert (start, stop) == (got, got + 1)  # every slice once, in order
            np.testing.assert_array_equal(slab, whole[:, start:stop])
            got = stop
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == image.shape[0]
    # the accumulator spans about a patch depth (8 of 960 slices), not the image
    assert peak < whole.nbytes / 8
