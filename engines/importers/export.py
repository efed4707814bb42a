"""Export one nnU-Net v2 fold to ONNX and check the export with ONNX Runtime.

The network is built as ``nnUNetPredictor.initialize_from_trained_model_folder`` builds it
(nnunetv2 2.8.1, ``inference/predict_from_raw_data.py``): ``PlansManager(plans)
.get_configuration(c)``, ``determine_num_input_channels``, the label manager's
``num_segmentation_heads``, then ``nnUNetTrainer.build_network_architecture``, which is
``get_network_from_plans(..., allow_init=True, deep_supervision=False)``. Trainers that
override ``build_network_architecture`` are not reproduced (the trainer module needs the
training stack); the strict weight load below refuses a network whose parameters differ.

torch and nnunetv2 are imported when a function here runs (``pip install -e .[nnunet]``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from segnode.engines.importers import ModelImportError

OPSET = 17


@dataclass(frozen=True)
class Checkpoint:
    """What the import needs from one ``checkpoint_*.pth``."""

    fold: int | str
    path: Path
    weights: dict[str, Any]
    trainer_name: str
    configuration: str | None
    mirror_axes: tuple[int, ...] | None


@dataclass(frozen=True)
class ExportCheck:
    """ONNX Runtime against torch on one random patch."""

    fold: int | str
    onnx_path: Path
    max_abs_diff: float
    max_abs_logit: float


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ModelImportError(
            "importing an nnU-Net model needs torch and nnunetv2 (pip install -e .[nnunet])"
        ) from exc
    return torch


def load_checkpoint(fold: int | str, path: Path) -> Checkpoint:
    """Read a checkpoint as nnU-Net does (``torch.load(..., weights_only=False)`` on the CPU).

    Raises
    ------
    ModelImportError
        The file is not a torch checkpoint or has no ``network_weights``.
    """
    torch = _torch()
    try:
        raw = torch.load(str(path), map_location=torch.device("cpu"), weights_only=False)
    except Exception as exc:  # pickle, zip and torch errors alike: the file is not usable
        raise ModelImportError(f"fold {fold}: cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("network_weights"), dict):
        raise ModelImportError(f"fold {fold}: {path} has no network_weights (not nnU-Net's)")
    init_args = raw.get("init_args") or {}
    axes = raw.get("inference_allowed_mirroring_axes")
    return Checkpoint(
        fold=fold,
        path=path,
        weights=raw["network_weights"],
        trainer_name=str(raw.get("trainer_name", "")),
        configuration=init_args.get("configuration") if isinstance(init_args, dict) else None,
        mirror_axes=tuple(int(a) for a in axes) if axes is not None else None,
    )


def build_network(plans: dict[str, Any], dataset: dict[str, Any], configuration: str) -> Any:
    """The network of ``configuration`` exactly as nnU-Net builds it for inference."""
    _torch()
    try:
        from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
        from nnunetv2.utilities.label_handling.label_handling import (
            determine_num_input_channels,
        )
        from nnunetv2.utilities.plans_handling.plans_handler import PlansManager
    except ImportError as exc:
        raise ModelImportError(
            f"importing an nnU-Net model needs nnunetv2 (pip install -e .[nnunet]): {exc}"
        ) from exc
    manager = PlansManager(plans)
    config = manager.get_configuration(configuration)
    inputs = determine_num_input_channels(manager, config, dataset)
    outputs = manager.get_label_manager(dataset).num_segmentation_heads
    try:
        return get_network_from_plans(
            config.network_arch_class_name,
            config.network_arch_init_kwargs,
            config.network_arch_init_kwargs_req_import,
            inputs,
            outputs,
            allow_init=True,
            deep_supervision=False,
        )
    except Exception as exc:  # an unknown class or kwargs: the plans name a network we lack
        raise ModelImportError(
            f"plans.json: configurations[{configuration!r}].architecture: cannot build "
            f"{config.network_arch_class_name}: {exc}"
        ) from exc


def load_weights(network: Any, checkpoint: Checkpoint) -> None:
    """Load ``network_weights`` strictly; a mismatch names the fold and the first bad key.

    Raises
    ------
    ModelImportError
        A key is missing, unexpected, or has another shape than the plans' network.
    """
    own = network.state_dict()
    given = checkpoint.weights
    where = f"fold {checkpoint.fold}: {checkpoint.path} does not match its plans"
    for key, tensor in own.items():
        if key not in given:
            raise ModelImportError(f"{where}: missing key {key!r}")
        shape = tuple(getattr(given[key], "shape", ()))
        if shape != tuple(tensor.shape):
            raise ModelImportError(
                f"{where}: {key!r} has shape {list(shape)}, the plans' network {list(tensor.shape)}"
            )
    extra = [k for k in given if k not in own]
    if extra:
        raise ModelImportError(f"{where}: unexpected key {extra[0]!r} ({len(extra)} in all)")
    network.load_state_dict(given, strict=True)


def export_onnx(network: Any, patch_size: tuple[int, ...], in_channels: int, path: Path) -> None:
    """Export ``network`` (eval mode) with a fixed patch and a dynamic batch dimension.

    Input ``"input"`` ``(N, C, z, y, x)``, output ``"logits"``; the TorchScript exporter
    (``dynamo=False``), opset :data:`OPSET`.
    """
    torch = _torch()
    network.eval()
    example = torch.zeros((1, in_channels, *patch_size), dtype=torch.float32)
    with warnings.catch_warnings(), torch.no_grad():
        # the legacy exporter's deprecation notice, the tracer's notes on nnU-Net's shape
        # checks and "instance_norm ... train=True" (InstanceNorm3d keeps no running
        # statistics: eval and train compute the same) say nothing about this export
        warnings.simplefilter("ignore")
        torch.onnx.export(
            network,
            (example,),
            str(path),
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )


def check_export(
    network: Any, onnx_path: Path, patch_size: tuple[int, ...], in_channels: int, fold: int | str
) -> ExportCheck:
    """Run the ONNX file with ONNX Runtime (CPU) and torch on one seeded random patch.

    Raises
    ------
    ModelImportError
        ONNX Runtime cannot load the file (an IR version newer than it reads, say), or the
        outputs differ by more than ``1e-3 * max(1, max |logit|)``.
    """
    import numpy as np
    import onnxruntime as ort

    torch = _torch()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, in_channels, *patch_size)).astype(np.float32)
    with torch.no_grad():
        ref = network(torch.from_numpy(x)).numpy()
    from segnode.engines.ort_backend import load_problem

    try:
        session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own pybind types, not one base class
        raise ModelImportError(
            f"fold {fold}: ONNX Runtime cannot load the export {onnx_path}: {load_problem(exc)}"
        ) from exc
    out = session.run(["logits"], {"input": x})[0]
    if out.shape != ref.shape:
        raise ModelImportError(
            f"fold {fold}: ONNX output shape {out.shape} differs from torch {ref.shape}"
        )
    diff = float(np.max(np.abs(out - ref)))
    scale = float(np.max(np.abs(ref)))
    if not diff <= 1e-3 * max(1.0, scale):
        raise ModelImportError(
            f"fold {fold}: ONNX export differs from torch by {diff:.3g} (logits up to {scale:.3g})"
        )
    return ExportCheck(fold, onnx_path, diff, scale)


def versions() -> dict[str, str]:
    """Versions of the packages the export used (for ``import.json``)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for package in ("nnunetv2", "torch", "dynamic_network_architectures", "onnx", "onnxruntime"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out
