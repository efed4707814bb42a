"""``segnode model import`` and ``segnode model calibrate``: the command line of model tools.

The node's CLI registers the sub-commands with :func:`add_model_parser` and dispatches to
:func:`run_model_command`::

    segnode model import nnunet FOLDER --name NAME [--folds 0 1 2 3 4]
            [--checkpoint final|best] [--configuration 3d_fullres]
            [--labels FILE|totalsegmentator] [--allow-generic]
            [--orientation CODE|source] [--model-version 1.0.0] [--out DIR] [--as-nnunet]
    segnode model import totalsegmentator WEIGHTS_DIR
            [--task total|total_fast|total_fastest] [--name total]
            [--labels FILE|totalsegmentator] [--allow-generic] [--model-version 1.0.0]
            [--out DIR]
    segnode model calibrate MANIFEST [--series DIR ...] [--spool DATA_DIR]
            [--precision int8|bf16] [--held-out N] [--threshold 0.99]
            [--tiles-per-series 8] [--max-rounds 4] [--fp32-leading N] [--threads N]

``calibrate`` is :func:`segnode.engines.calibrate.calibrate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from segnode.engines.base import EngineError


def add_model_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``model import nnunet`` and ``model import totalsegmentator``.

    Returns the ``model`` parser; the chosen action is in ``args.model_command`` and
    ``args.import_kind``.
    """
    model = subparsers.add_parser(
        "model", help="import trained models (nnU-Net, TotalSegmentator) and calibrate them"
    )
    actions = model.add_subparsers(dest="model_command", required=True)
    imp = actions.add_parser("import", help="import a trained model as ONNX + manifest")
    kinds = imp.add_subparsers(dest="import_kind", required=True)

    nn = kinds.add_parser("nnunet", help="an nnU-Net v2 trained-model folder")
    nn.add_argument("folder", type=Path, help="<results>/DatasetXXX_Name/<Trainer>__<Plans>__<cfg>")
    nn.add_argument("--name", required=True, help="model name (manifest NAME.json)")
    nn.add_argument("--folds", nargs="+", default=["0", "1", "2", "3", "4"], metavar="FOLD")
    nn.add_argument("--checkpoint", choices=("final", "best"), default="final")
    nn.add_argument(
        "--configuration", default=None, help="default: from the folder name, else 3d_fullres"
    )
    nn.add_argument(
        "--orientation",
        default=None,
        help="orientation code of the training arrays (e.g. SPL, SAL, SAR) or 'source'; "
        "default SAR for readers that reorient to RAS, else SPL (docs/import.md)",
    )
    nn.add_argument(
        "--as-nnunet",
        action="store_true",
        help="import one of TotalSegmentator's datasets with nnU-Net's defaults all the same "
        "(without it, such a folder is refused with the totalsegmentator command to use)",
    )
    _shared(nn)

    ts = kinds.add_parser("totalsegmentator", help="TotalSegmentator's weights (composite)")
    ts.add_argument(
        "weights_dir",
        type=Path,
        help="folder with Dataset291_... (~/.totalsegmentator/nnunet/results)",
    )
    ts.add_argument(
        "--task",
        default="total",
        choices=("total", "total_fast", "total_fastest"),
        help="total (datasets 291-295, 1.5 mm), total_fast (297, 3 mm: TotalSegmentator "
        "--fast) or total_fastest (298, 6 mm: --fastest)",
    )
    ts.add_argument("--name", default="total", help="model name (manifest NAME.json)")
    _shared(ts)

    cal = actions.add_parser(
        "calibrate",
        help="calibrate a trained model for the CPU (INT8 from representative series, or BF16), "
        "checked against FP32 on held-out series",
    )
    cal.add_argument("manifest", type=Path, help="the model's manifest (NAME.json) or folder")
    cal.add_argument(
        "--series",
        type=Path,
        nargs="+",
        default=[],
        metavar="DIR",
        help="representative CT series: a folder per series, or a folder of series folders",
    )
    cal.add_argument(
        "--spool",
        type=Path,
        default=None,
        metavar="DATA_DIR",
        help="also the series the node has received (its data_dir, or data_dir/spool)",
    )
    cal.add_argument("--precision", choices=("int8", "bf16"), default="int8")
    cal.add_argument(
        "--held-out",
        type=int,
        default=None,
        metavar="N",
        help="series kept for the accuracy guard, the last N (default: a third, at least 1)",
    )
    cal.add_argument(
        "--threshold",
        type=float,
        default=0.99,
        help="lowest Dice per label against FP32 the guard accepts (default 0.99)",
    )
    cal.add_argument("--tiles-per-series", type=int, default=8, metavar="N")
    cal.add_argument(
        "--max-rounds",
        type=int,
        default=4,
        metavar="N",
        help="rounds of keeping more measured layers in float (default 4)",
    )
    cal.add_argument(
        "--fp32-leading",
        type=int,
        default=None,
        metavar="N",
        help="bf16: run the first N convolutions in float32 (default: 0, then 3 and 6 "
        "where the guard fails)",
    )
    cal.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    return model  # type: ignore[no-any-return]


def _shared(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--labels",
        default=None,
        metavar="FILE|totalsegmentator",
        help="SNOMED CT mapping CSV (TotalSegmentator's format), or 'totalsegmentator' for "
        "the one in the installed package; without it every label gets a generic code",
    )
    p.add_argument(
        "--allow-generic",
        action="store_true",
        help="labels the CSV does not name get the generic code instead of an error",
    )
    p.add_argument("--model-version", default="1.0.0", help="the manifest's version")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: ./NAME)")


def run_model_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``segnode model import ...`` or ``segnode model calibrate ...``; returns the exit
    status (1 with a message on error, or when the calibration fails its guard)."""
    stream = out or sys.stdout
    if args.model_command == "calibrate":
        return _calibrate(args, stream)
    from segnode.engines.importers.labels import load_label_csv

    try:
        codes = load_label_csv(args.labels) if args.labels else None
        source = args.labels or "labels CSV"
        target = args.out or Path(args.name)
        if args.import_kind == "nnunet":
            from segnode.engines.importers.nnunet import import_nnunet
            from segnode.engines.importers.nnunet_plans import parse_fold
            from segnode.engines.importers.totalsegmentator import profile_advice

            advice = profile_advice(args.folder)
            if advice is not None and not args.as_nnunet:
                print(f"segnode: model import: {advice}", file=sys.stderr)
                return 1

            report = import_nnunet(
                args.folder,
                target,
                args.name,
                folds=[parse_fold(f) for f in args.folds],
                checkpoint=args.checkpoint,
                configuration=args.configuration,
                codes=codes,
                codes_source=source,
                allow_generic=args.allow_generic,
                orientation=args.orientation,
                version=args.model_version,
            )
            for line in report.lines():
                print(line, file=stream)
            return 0
        from segnode.engines.importers.totalsegmentator import import_totalsegmentator

        reports, composite, path, notes = import_totalsegmentator(
            args.weights_dir,
            target,
            args.name,
            task=args.task,
            codes=codes,
            codes_source=source,
            allow_generic=args.allow_generic,
            version=args.model_version,
        )
        for report in reports:
            for line in report.lines():
                print(line, file=stream)
        print(
            f"composite {composite['name']} {composite['version']}: "
            f"{len(composite['labels'])} labels from {len(composite['parts'])} parts",
            file=stream,
        )
        for note in notes:
            print(f"  {note}", file=stream)
        print(f"wrote {path}", file=stream)
        return 0
    except EngineError as exc:
        print(f"segnode: model import: {exc}", file=sys.stderr)
        return 1


def _calibrate(args: argparse.Namespace, stream: TextIO) -> int:
    """``segnode model calibrate``: 0 and the report, or 1 with the reason (a failed guard
    prints the Dice it found and writes nothing)."""
    from segnode.engines.calibrate import GuardFailed, calibrate

    try:
        report = calibrate(
            args.manifest,
            args.series,
            spool=args.spool,
            precision=args.precision,
            held_out=args.held_out,
            threshold=args.threshold,
            tiles_per_series=args.tiles_per_series,
            max_rounds=args.max_rounds,
            fp32_leading=args.fp32_leading,
            threads=args.threads,
            progress=lambda line: print(line, file=stream, flush=True),
        )
    except GuardFailed as exc:
        for line in exc.report.lines():
            print(line, file=stream)
        print(f"segnode: model calibrate: {exc}", file=sys.stderr)
        return 1
    except EngineError as exc:
        print(f"segnode: model calibrate: {exc}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line, file=stream)
    return 0
