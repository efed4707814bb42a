"""The default "tissue" model gives the same label maps as before it returned labels.

Up to commit d294886 the model returned one-hot probabilities ``(N, 6, Z, Y, X)`` for
16x512x512 patches overlapping by 0.125 on every axis, which the sliding window blended
(Gaussian weights) and arg-maxed. It now returns the label itself for 2x512x512 patches that
overlap in-plane only, reads opened HU instead of opened masks, and runs patch by patch on
each thread. The label maps must not change by a single voxel.

The references below were computed on 2026-12-04 with the model and the code of commit
d294886 (``segnode.engines.base.create_engine("onnxruntime")``, the manifest
``engines/models/tissue/tissue.json`` of that commit, default threads): the SHA-256 of the
uint8 label map's bytes (C order) and ``np.bincount(labels.ravel(), minlength=6)``.
The real-CT cases read ``../shared/data`` beside the project and skip when it is absent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from segnode.engines import create_engine, load_manifest
from segnode.engines.base import Engine
from segnode.engines.models import default_manifest_path
from segnode.node.ingest.volume import assemble_from_datasets, assemble_volume
from tests.fixtures.synthetic import AXIAL, CORONAL, SAGITTAL, PhantomGeometry, synthetic_datasets

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

HuArray = npt.NDArray[np.float32]


def _synthetic(geometry: PhantomGeometry, seed: int) -> Callable[[], HuArray]:
    def make() -> HuArray:
        return assemble_from_datasets(synthetic_datasets(geometry, seed=seed)).hu

    return make


def _real(folder: str) -> Callable[[], HuArray]:
    def read() -> HuArray:
        path = DATA / folder
        if not path.is_dir():
            pytest.skip(f"real CT data not available at {path}")
        return assemble_volume(sorted(p for p in path.iterdir() if p.is_file()), min_slices=2).hu

    return read


# name: (volume, shape, sha256 of the label bytes, voxels per label 0..5)
REFERENCES: dict[str, tuple[Callable[[], HuArray], tuple[int, int, int], str, list[int]]] = {
    "synthetic 512x512x128 axial": (
        _synthetic(PhantomGeometry(slices=128, orientation=AXIAL), seed=0),
        (128, 512, 512),
        "fa54d48221d81641294f45c7487817b15a69a60b5699d63be85940060d15e543",
        [20269568, 278272, 1894144, 2680869, 8167899, 263680],
    ),
    "synthetic 256x320x40 sagittal (padded in-plane)": (
        _synthetic(PhantomGeometry(rows=256, columns=320, slices=40, orientation=SAGITTAL), seed=1),
        (40, 256, 320),
        "61841f007a775e7672d6de7cef55ada1bfb1735ce196f0fa40e7ee6dcb12f453",
        [1979680, 49440, 185520, 246574, 789986, 25600],
    ),
    "synthetic 544x608x20 coronal (overlapping in-plane patches)": (
        _synthetic(PhantomGeometry(rows=544, columns=608, slices=20, orientation=CORONAL), seed=2),
        (20, 544, 608),
        "e7a451a50902c34f6c92ffc0e8c692f59db044feab2fba177db16ead64e6f531",
        [3996800, 49120, 374100, 532158, 1610902, 51960],
    ),
    "ct-phantom-philips-28": (
        _real("ct-phantom-philips-28"),
        (28, 512, 512),
        "2115027a283bd4c2c6d16cb87113de1113e3924077c98ff5dc19994b1a028acb",
        [5650203, 117852, 1042429, 50935, 170764, 307849],
    ),
    "ct-liver-3slice (padded along z)": (
        _real("ct-liver-3slice"),
        (3, 512, 512),
        "2e6f85ad8d8fa9ba0ecc9e115dae08c827b43533f8e867c7323303240b9770f2",
        [370821, 16282, 74714, 121584, 189310, 13721],
    ),
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = create_engine("onnxruntime")
    engine.load(load_manifest(default_manifest_path()))
    yield engine
    engine.close()


@pytest.mark.parametrize("name", list(REFERENCES))
def test_label_maps_match_the_probability_model(engine: Engine, name: str) -> None:
    make, shape, digest, counts = REFERENCES[name]
    hu = make()
    assert hu.shape == shape
    labels = engine.segment(hu)
    assert labels.dtype == np.uint8 and labels.shape == shape
    assert np.bincount(labels.ravel(), minlength=6).tolist() == counts
    assert hashlib.sha256(np.ascontiguousarray(labels).tobytes()).hexdigest() == digest


def test_one_thread_gives_the_same_labels(engine: Engine) -> None:
    hu = _synthetic(PhantomGeometry(rows=256, columns=256, slices=9), seed=4)()
    single = create_engine("onnxruntime", threads=1)
    single.load(load_manifest(default_manifest_path()))
    try:
        np.testing.assert_array_equal(single.segment(hu), engine.segment(hu))
    finally:
        single.close()
