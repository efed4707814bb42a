"""Model manifests: the JSON file next to each ONNX model describing how to run it.

A manifest ``<model>.json`` sits next to ``<model>.onnx`` and holds::

    {
      "name": "tissue", "version": "1.0.0", "onnx": "tissue.onnx",
      "input_name": "ct", "output_name": "logits",
      "output_kind": "logits",            # logits | probabilities | labels
      "patch_size": [64, 256, 256],       # (z, y, x) voxels
      "overlap": 0.25,                    # fraction of the patch: every axis, or [z, y, x]
      "batch": {"min": 1, "opt": 1, "max": 2},
      "fp16": false,                      # may a backend run it in half precision
      "preprocessing": {"clip": [-1024, 3071], "scale": 1.0, "offset": 0.0},
      "labels": [
        {"value": 1, "name": "Body", "category": ["91723000", "SCT", "Anatomical Structure"],
         "type": ["38266002", "SCT", "Entire body"], "color": [255, 224, 189]}
      ]
    }

The network sees ``clip(HU) * scale + offset`` as a float32 tensor of shape
``(N, 1, Z, Y, X)`` and returns ``(N, C, Z, Y, X)`` with ``C = 1 + number of labels``;
channel 0 is background, channel ``i`` is label value ``i``. A model with ``"output_kind":
"labels"`` returns the label value itself, ``(N, 1, Z, Y, X)``.

Version 2 (``"manifest_version": 2``) describes a trained model (nnU-Net v2 and the like)
completely: the grid it was trained on, its intensity normalisation, resampling, test-time
mirroring, folds and region outputs. All version-1 keys keep their meaning; ``"onnx"`` is
replaced by ``"folds"`` (one ONNX file per fold; their logits are averaged)::

    {
      "manifest_version": 2,
      "name": "abdomen", "version": "1.0.0",
      "folds": ["fold_0.onnx", "fold_1.onnx"],
      "input_name": "input", "output_name": "logits", "output_kind": "logits",
      "patch_size": [96, 160, 160],       # model axes (after transpose_forward)
      "overlap": 0.5,                     # 1 - nnU-Net's tile_step_size
      "sigma_scale": 0.125,               # Gaussian sigma as a fraction of the patch
      "mirror_axes": [0, 1, 2],           # test-time mirroring, model axes; [] for none
      "geometry": {
        "spacing": [1.5, 1.5, 1.5],       # target spacing, mm, model axes
        "orientation": "SAR",             # array the model's reader sees, or "source"
        "transpose_forward": [0, 1, 2], "transpose_backward": [0, 1, 2],
        "gantry_tilt_allowed": false
      },
      "preprocessing": {
        "crop_to_nonzero": true,
        "normalization": "ct",            # "ct" (nnU-Net CTNormalization) or "linear"
        "intensity": {"mean": 100.0, "std": 200.0,
                      "percentile_00_5": -1000.0, "percentile_99_5": 1500.0}
      },
      "resampling": {"data_order": 3, "logits_order": 1, "order_z": 0,
                     "anisotropy_threshold": 3.0, "force_separate_z": null,
                     "scheme": "nnunet"},      # or "totalsegmentator"
      "labels": [...],                    # as version 1
      "regions": [[1, 2], [2]], "regions_class_order": [1, 2]   # optional: sigmoid outputs
    }

A composite model (TotalSegmentator style: several nnU-Net datasets merged into one label
space) is a version-2 manifest with ``"parts"`` instead of folds and geometry; each part is a
version-2 manifest of its own (path relative to the composite file) and maps its label values
(string keys) to the composite's labels, which are merged in order (later parts overwrite)::

    {
      "manifest_version": 2, "name": "total", "version": "1.0.0",
      "parts": [{"manifest": "part_291/model.json", "labels": {"1": 1, "2": 2}},
                {"manifest": "part_292/model.json", "labels": {"1": 3, "5": 4}}],
      "labels": [...]                     # merged labels 1..N, as version 1
    }

The order of operations, and what each key means exactly, is in docs/integration.md
("Model contract v2") and :mod:`segnode.engines.preprocess`. A version-1 manifest gets an equivalent
:class:`ModelContract` (source orientation, no resampling, its clip/scale/offset), so the
preprocessing runtime runs both.

This module holds the types a manifest becomes and parses no JSON:
:func:`segnode.engines.manifest_parse.load_manifest` reads and checks a manifest file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import EngineError
from segnode.engines.preprocess.intensity import LinearNormalization, Normalization
from segnode.engines.preprocess.orientation import SOURCE
from segnode.engines.preprocess.resampling import ANISO_THRESHOLD

Code = tuple[str, str, str]  # (value, scheme designator, meaning)


class ManifestError(EngineError):
    """A model manifest is unreadable or invalid; the message names the file and the field."""


@dataclass(frozen=True)
class LabelSpec:
    """One output class of a model, with its SNOMED CT codes.

    ``modifier`` qualifies ``type`` (laterality: left, right); ``anatomic_region`` and its
    ``anatomic_region_modifier`` say where the structure lies, for types that do not.
    """

    value: int
    name: str
    category: Code
    type: Code
    color: tuple[int, int, int] = (255, 0, 0)
    modifier: Code | None = None
    anatomic_region: Code | None = None
    anatomic_region_modifier: Code | None = None


RESAMPLING_SCHEMES = ("nnunet", "totalsegmentator")
"""Values of ``resampling.scheme`` (:attr:`ModelContract.scheme`)."""


@dataclass(frozen=True)
class ModelContract:
    """How a trained model sees a volume: grid, orientation, intensities, resampling,
    mirroring and outputs (manifest version 2; derived for version 1).

    All axis-indexed fields are in the model's axis order, i.e. after the reorientation to
    ``orientation`` and ``transpose_forward`` (as nnU-Net's plans store them).

    Attributes
    ----------
    spacing
        Target voxel spacing in mm; ``None`` runs the model on the source grid (version 1).
    orientation
        Orientation code of the array the model's reader produces (``"SAR"``: index 0
        toward superior, 1 toward anterior, 2 toward the patient's right), or ``"source"``.
    transpose_forward, transpose_backward
        nnU-Net's axis permutations applied after the reorientation and undone before it.
    gantry_tilt_allowed
        Whether tilted or oblique series are accepted (mapped to the nearest axes).
    crop_to_nonzero
        Crop to the bounding box of non-zero voxels before normalising (nnU-Net).
    normalization
        :class:`CTNormalization` or :class:`LinearNormalization`.
    data_order, logits_order, order_z
        Interpolation orders of the image, of the logits back to the source grid and of the
        separate low-resolution axis.
    anisotropy_threshold, force_separate_z
        When to resample the low-resolution axis separately (nnU-Net's ``ANISO_THRESHOLD``
        and ``force_separate_z``: ``None`` decides from the spacings).
    scheme
        ``"nnunet"``: nnU-Net's order of operations (crop, normalise, resample with
        centre-aligned grids; the scores back to the source grid). ``"totalsegmentator"``:
        TotalSegmentator's ``change_spacing`` first (the HU image resampled to ``spacing``
        on corner-aligned grids with ``data_order``, truncated to integers), then crop and
        normalise on that grid, and the label map back with nearest neighbours (corner
        aligned); see :func:`segnode.engines.preprocess.pipeline.run_model`.
    sigma_scale
        Gaussian importance sigma as a fraction of the patch size.
    mirror_axes
        Model axes mirrored for test-time augmentation (all non-empty combinations).
    regions, regions_class_order
        For region-based models (sigmoid outputs): the label values of each output channel
        and the label written where each region's probability exceeds 0.5, in order.
    """

    spacing: tuple[float, float, float] | None = None
    orientation: str = SOURCE
    transpose_forward: tuple[int, int, int] = (0, 1, 2)
    transpose_backward: tuple[int, int, int] = (0, 1, 2)
    gantry_tilt_allowed: bool = False
    crop_to_nonzero: bool = False
    normalization: Normalization = field(default_factory=LinearNormalization)
    data_order: int = 3
    logits_order: int = 1
    order_z: int = 0
    anisotropy_threshold: float = ANISO_THRESHOLD
    force_separate_z: bool | None = None
    scheme: str = "nnunet"
    sigma_scale: float = 0.125
    mirror_axes: tuple[int, ...] = ()
    regions: tuple[tuple[int, ...], ...] | None = None
    regions_class_order: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CompositePart:
    """One part of a composite model: a version-2 manifest and where its labels go.

    Attributes
    ----------
    manifest
        The part's own version-2 manifest (folds, geometry, preprocessing, labels).
    label_map
        ``(part label value, merged label value)`` pairs; part labels not listed are dropped.
    """

    manifest: ModelManifest
    label_map: tuple[tuple[int, int], ...]

    def lookup_table(self) -> npt.NDArray[np.uint8]:
        """uint8 table from the part's label values (index) to merged values (0: dropped)."""
        table = np.zeros(256, dtype=np.uint8)
        for source, merged in self.label_map:
            table[source] = merged
        return table


@dataclass(frozen=True)
class ModelManifest:
    """Everything a backend needs to run one ONNX model."""

    name: str
    version: str
    onnx_path: Path
    labels: tuple[LabelSpec, ...]
    patch_size: tuple[int, int, int]
    overlap: float | tuple[float, float, float] = 0.5
    """One fraction for every axis, or ``(z, y, x)``."""
    input_name: str = "input"
    output_name: str = "output"
    output_kind: str = "logits"
    batch_min: int = 1
    batch_opt: int = 1
    batch_max: int = 1
    fp16: bool = False
    clip: tuple[float, float] | None = None
    scale: float = 1.0
    offset: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    manifest_version: int = 1
    fold_paths: tuple[Path, ...] = ()
    """Version 2: one ONNX file per fold (``onnx_path`` is the first)."""
    contract: ModelContract | None = None
    """Version 2: the model contract; ``None`` for version 1 (see :meth:`model_contract`)."""
    parts: tuple[CompositePart, ...] = ()
    """Composite (version 2): the models merged into :attr:`labels`, in order; their fold
    files are the model's (no folds or contract of its own)."""
    precision: str = "fp32"
    """The arithmetic the model runs in: ``"fp32"``; ``"int8"`` (static INT8 QDQ files made
    by ``segnode model calibrate``, :attr:`int8_fold_paths`); ``"bf16"`` (checked by
    ``segnode model calibrate --precision bf16`` for a BF16 runtime). Loaded engines
    replace it with what they run (:func:`segnode.engines.base.run_precision`); the SEG's
    and SR's algorithm identification carry it."""
    int8_fold_paths: tuple[Path, ...] = ()
    """Version 2 with ``"precision": "int8"``: one INT8 QDQ ONNX file per fold, in the order
    of :attr:`fold_paths` (the FP32 files stay for the other engines)."""
    int8_tensorrt_fold_paths: tuple[Path, ...] = ()
    """The same INT8 model in TensorRT's form (symmetric INT8 activations), one file per fold,
    for the ``tensorrt`` engine's explicit-quantization build; empty where calibration did
    not write it."""
    calibration: dict[str, Any] = field(default_factory=dict)
    """The manifest's ``"calibration"`` section (calibration file, its SHA-256, the layers
    kept in float, the accuracy guard's Dice): see :mod:`segnode.engines.calibrate`."""

    @property
    def is_trained(self) -> bool:
        """True for a version-2 manifest (one model or a composite): it runs through
        :func:`segnode.engines.trained.segment_trained`, not
        :meth:`segnode.engines.base.Engine.segment`."""
        return self.manifest_version == 2

    @property
    def is_composite(self) -> bool:
        """True for a composite model (``"parts"``)."""
        return bool(self.parts)

    def model_files(self, *, int8: bool | str = False) -> tuple[ModelManifest, ...]:
        """One single-file manifest per ONNX file a backend loads, in order.

        Version 1: the manifest itself. Version 2: one per fold (``onnx_path`` that fold,
        ``name`` suffixed ``.foldN`` so that each fold has its own engine-cache entries).
        Composite: every fold of every part, part by part (names
        ``<composite>.partJ.<part>.foldN``). ``int8``: a model calibrated to INT8 gives its
        INT8 QDQ files instead (names ``.foldN.int8``), for the engines that run them
        (ONNX Runtime and OpenVINO on the CPU); ``int8="tensorrt"`` its files in TensorRT's
        form, where calibration wrote them; any other model its float files.
        """
        if self.parts:
            return tuple(
                replace(unit, name=f"{self.name}.part{j}.{unit.name}")
                for j, part in enumerate(self.parts)
                for unit in part.manifest.model_files(int8=int8)
            )
        if self.manifest_version == 1 or not self.fold_paths:
            return (self,)
        quantized = self.int8_tensorrt_fold_paths if int8 == "tensorrt" else self.int8_fold_paths
        if int8 and self.precision == "int8" and quantized:
            return tuple(
                replace(self, name=f"{self.name}.fold{i}.int8", onnx_path=path, fold_paths=(path,))
                for i, path in enumerate(quantized)
            )
        return tuple(
            replace(self, name=f"{self.name}.fold{i}", onnx_path=path, fold_paths=(path,))
            for i, path in enumerate(self.fold_paths)
        )

    @property
    def num_classes(self) -> int:
        """Number of output channels, background included."""
        return 1 + len(self.labels)

    @property
    def output_channels(self) -> int:
        """Channels of the network's output: the regions of a region-based model, else
        :attr:`num_classes` (1 for ``output_kind="labels"``)."""
        if self.contract is not None and self.contract.regions is not None:
            return len(self.contract.regions)
        return 1 if self.output_kind == "labels" else self.num_classes

    def model_contract(self) -> ModelContract:
        """The contract of version 2, or the one a version-1 manifest implies (source grid
        and orientation, its clip/scale/offset, no cropping, no mirroring)."""
        if self.contract is not None:
            return self.contract
        return ModelContract(normalization=LinearNormalization(self.clip, self.scale, self.offset))

    def sha256(self) -> str:
        """SHA-256 of the ONNX file (engine cache key)."""
        h = hashlib.sha256()
        with self.onnx_path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def label(self, value: int) -> LabelSpec:
        """Return the label with ``value``."""
        for spec in self.labels:
            if spec.value == value:
                return spec
        raise KeyError(value)

    def check_tensors(self, where: str, inputs: Collection[str], outputs: Collection[str]) -> None:
        """Check that a model has this manifest's input and output tensors.

        Parameters
        ----------
        where
            The model as the message names it (``model 'tissue'``, ``model tissue on URL``).
        inputs, outputs
            The names of the model's input and output tensors.

        Raises
        ------
        EngineError
            If the model lacks either tensor; the message lists the names the model has.
        """
        for role, name, names in (
            ("input", self.input_name, inputs),
            ("output", self.output_name, outputs),
        ):
            if name not in names:
                raise EngineError(f"{where}: no {role} named {name!r}; model has {sorted(names)}")


def check_runnable(manifest: ModelManifest) -> None:
    """Refuse a manifest the node cannot run as its contract says.

    Version 1 runs on the source grid (:meth:`segnode.engines.base.Engine.segment`); version 2
    (one trained model or a composite) through :func:`segnode.engines.trained.segment_trained`,
    nnU-Net's blended sliding window over every fold. That window blends scores, so a
    version-2 model whose network returns labels (``"output_kind": "labels"``) is refused.

    Raises
    ------
    ManifestError
        For a manifest (or a composite's part) that no backend runs as its contract says.
    """
    if manifest.manifest_version == 1:
        return
    for part in manifest.parts:
        check_runnable(part.manifest)
    if not manifest.parts and manifest.output_kind == "labels":
        raise ManifestError(
            f"model {manifest.name} {manifest.version}: output_kind 'labels' cannot run as a "
            "version-2 (trained) model: nnU-Net's sliding window blends logits or "
            "probabilities (export the network's scores)"
        )
