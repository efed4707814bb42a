"""``segnode model import nnunet``: an nnU-Net v2 model folder to a self-contained model folder.

The folder written holds::

    OUT/<name>.json        the version-2 manifest (docs/integration.md, section 8)
    OUT/fold_N.onnx        one ONNX export per fold
    OUT/plans.json         copies of the source's plans and dataset, for provenance
    OUT/dataset.json
    OUT/import.json        source path, folds, checkpoint and its SHA-256 per fold, versions,
                           date, the export check per fold, labels given generic codes

The manifest is loaded with :func:`segnode.engines.manifest_parse.load_manifest` before the import
reports success.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from segnode.engines.base import EngineError
from segnode.engines.importers import ModelImportError
from segnode.engines.importers.labels import LabelCodes, label_entries
from segnode.engines.importers.nnunet_plans import (
    ModelFolder,
    default_orientation,
    manifest_dict,
    output_layout,
    read_model_folder,
    resolve_configuration,
)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class ImportReport:
    """What an import wrote and checked; :meth:`lines` is what the CLI prints."""

    out_dir: Path
    manifest_path: Path
    manifest: dict[str, Any]
    checks: list[tuple[str, float, float]] = field(default_factory=list)
    """``(fold, max |onnx - torch|, max |logit|)`` per fold."""
    generic: list[str] = field(default_factory=list)
    orientation_note: str = ""

    def lines(self) -> list[str]:
        """Human-readable summary, one line each."""
        m = self.manifest
        geo = m["geometry"]
        out = [
            f"model {m['name']} {m['version']}: {_count(len(m['labels']), 'label')}, "
            f"{_count(len(m['folds']), 'fold')}, patch {m['patch_size']}, "
            f"spacing {geo['spacing']} mm, "
            f"orientation {geo['orientation']}{self.orientation_note}",
        ]
        for fold, diff, scale in self.checks:
            out.append(
                f"  fold {fold}: ONNX Runtime vs torch on a random patch: "
                f"max |diff| {diff:.2e} (logits up to {scale:.2f})"
            )
        if self.generic:
            out.append(
                f"  {_count(len(self.generic), 'label')} got the generic code "
                f"SCT 85756007 'Tissue': {', '.join(self.generic)}"
            )
        out.append(f"wrote {self.manifest_path}")
        return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def sha256(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` as indented JSON, atomically (temporary file, fsync, rename).

    The file is readable by all (0644 less the umask), like the ONNX files beside it, so that a
    node running as its own service user can read a model imported by an administrator.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o644 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_manifest(path: Path) -> None:
    """Load ``path`` with the node's own loader; the import fails if it does not load."""
    from segnode.engines.manifest_parse import load_manifest

    try:
        load_manifest(path)
    except EngineError as exc:
        raise ModelImportError(f"the manifest written does not load: {exc}") from exc


def import_nnunet(
    folder: Path,
    out_dir: Path,
    name: str,
    *,
    folds: Sequence[int | str] = (0, 1, 2, 3, 4),
    checkpoint: str = "final",
    configuration: str | None = None,
    codes: Mapping[str, LabelCodes] | None = None,
    codes_source: str = "labels CSV",
    allow_generic: bool = False,
    orientation: str | None = None,
    version: str = "1.0.0",
    manifest_filename: str | None = None,
    overlap: float = 0.5,
    mirror: bool = True,
    resampling: dict[str, Any] | None = None,
    spacing: Sequence[float] | None = None,
    profile: str | None = None,
) -> ImportReport:
    """Import an nnU-Net v2 trained-model folder (see the module docstring for the output).

    Parameters
    ----------
    folder, folds, checkpoint, configuration
        The trained-model folder and which of it to import, as
        :func:`segnode.engines.importers.nnunet_plans.read_model_folder` reads them.
    out_dir
        The model folder to write (created; existing files of the same names are replaced).
    name
        The model's name; the manifest is ``<name>.json`` unless ``manifest_filename``.
    codes, codes_source, allow_generic
        The parsed label CSV (``None``: every label generic), its name, and whether labels
        it does not name may take the generic code.
    orientation
        The orientation code of the training arrays; default
        :func:`segnode.engines.importers.nnunet_plans.default_orientation`.
    version
        The manifest's version string.
    overlap, mirror, resampling, spacing, profile
        Overrides of a profile (TotalSegmentator: overlap 0.2, no mirroring, order-1
        resampling to 1.5 mm), recorded in ``import.json``.

    Raises
    ------
    ModelImportError
        Anything that stops the import; the message names the file, fold or field.
    """
    if not _NAME.fullmatch(name):
        raise ModelImportError(
            f"--name: {name!r}: letters, digits, '.', '_' and '-' only (it names files)"
        )
    source = read_model_folder(folder, list(folds), checkpoint, configuration)
    layout = output_layout(source.dataset, str(folder / "dataset.json"))
    labels, generic = label_entries(
        layout.names, codes, allow_generic=allow_generic, source=codes_source
    )
    chosen = orientation or default_orientation(source.plans, source.dataset)

    # the manifest's pure checks first: a plan the contract cannot express fails before export
    manifest_for = functools.partial(
        manifest_dict,
        source.plans,
        source.dataset,
        source.configuration,
        name=name,
        version=version,
        folds=[f"fold_{f}.onnx" for f, _ in source.checkpoints],
        labels=labels,
        orientation=chosen,
        overlap=overlap,
        resampling=resampling,
        spacing=spacing,
    )
    manifest_for(mirror_axes=None)

    # everything is written to a staging folder beside OUT and moved in at the end, the
    # manifest last: a failed import leaves OUT as it was
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.import-"))
    try:
        report = _export_all(
            source, staging, out_dir, name, manifest_for, generic, chosen, manifest_filename,
            checkpoint=checkpoint, codes_source=codes_source if codes else None,
            orientation_default=orientation is None, mirror=mirror, profile=profile,
        )  # fmt: skip
        _publish(staging, out_dir, report.manifest_path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


def _export_all(
    source: ModelFolder,
    staging: Path,
    out_dir: Path,
    name: str,
    manifest_for: Callable[..., dict[str, Any]],
    generic: list[str],
    chosen: str,
    manifest_filename: str | None,
    *,
    checkpoint: str,
    codes_source: str | None,
    orientation_default: bool,
    mirror: bool,
    profile: str | None,
) -> ImportReport:
    """Export every fold into ``staging`` and write the manifest (``manifest_for`` given the
    mirror axes), copies and ``import.json`` there; the report names the final paths in
    ``out_dir``."""
    from segnode.engines.importers import export

    folder = source.path
    config = resolve_configuration(source.plans, source.configuration)
    patch = tuple(int(v) for v in config["patch_size"])
    in_channels = len(source.dataset.get("channel_names", source.dataset.get("modality", {})))
    onnx_names = [f"fold_{f}.onnx" for f, _ in source.checkpoints]
    checks: list[tuple[str, float, float]] = []
    provenance: list[dict[str, Any]] = []
    mirror_axes: tuple[int, ...] | None = None
    trainer = ""
    for (fold, ckpt_path), onnx_name in zip(source.checkpoints, onnx_names, strict=True):
        ckpt = export.load_checkpoint(fold, ckpt_path)
        if ckpt.configuration not in (None, source.configuration):
            raise ModelImportError(
                f"fold {fold}: {ckpt_path} was trained with configuration "
                f"{ckpt.configuration!r}, importing {source.configuration!r} (--configuration)"
            )
        if not provenance:
            mirror_axes, trainer = ckpt.mirror_axes, ckpt.trainer_name
        network = export.build_network(source.plans, source.dataset, source.configuration)
        export.load_weights(network, ckpt)
        onnx_path = staging / onnx_name
        export.export_onnx(network, patch, in_channels, onnx_path)
        check = export.check_export(network, onnx_path, patch, in_channels, fold)
        checks.append((str(fold), check.max_abs_diff, check.max_abs_logit))
        provenance.append(
            {
                "fold": fold,
                "checkpoint": str(ckpt_path.resolve()),
                "checkpoint_sha256": sha256(ckpt_path),
                "trainer_name": ckpt.trainer_name,
                "inference_allowed_mirroring_axes": list(ckpt.mirror_axes)
                if ckpt.mirror_axes is not None
                else None,
                "onnx": onnx_name,
                "onnx_sha256": sha256(onnx_path),
                "onnx_vs_torch_max_abs_diff": check.max_abs_diff,
            }
        )
        del network, ckpt

    manifest = manifest_for(mirror_axes=mirror_axes if mirror else None)
    manifest_name = manifest_filename or f"{name}.json"
    for copied in ("plans.json", "dataset.json"):
        shutil.copyfile(folder / copied, staging / copied)
    write_json(
        staging / "import.json",
        {
            "source": str(folder.resolve()),
            "importer": "segnode model import nnunet",
            "profile": profile,
            "configuration": source.configuration,
            "checkpoint": checkpoint,
            "trainer_name": trainer,
            "folds": provenance,
            "orientation": chosen,
            "orientation_default": orientation_default,
            "labels_csv": codes_source,
            "generic_labels": generic,
            "versions": export.versions(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    )
    write_json(staging / manifest_name, manifest)
    check_manifest(staging / manifest_name)
    note = " (default for this reader: docs/import.md)" if orientation_default else ""
    return ImportReport(out_dir, out_dir / manifest_name, manifest, checks, generic, note)


def _publish(staging: Path, out_dir: Path, manifest_name: str) -> None:
    """Move the staged files into ``out_dir`` (created if need be), the manifest last."""
    out_dir.mkdir(exist_ok=True)
    names = sorted(p.name for p in staging.iterdir() if p.name != manifest_name)
    for file_name in [*names, manifest_name]:
        os.replace(staging / file_name, out_dir / file_name)
