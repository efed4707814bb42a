"""The ``segnode`` command line.

Every subcommand accepts ``--config FILE`` and ``--data-dir DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path

from sqlalchemy.exc import OperationalError

from segnode.node import __version__
from segnode.node.config import Config, load_config
from segnode.node.errors import ConfigError, SegnodeError
from segnode.node.peers import parse_peer
from segnode.node.web.facts import jobs_facts, ledger_status, send_seconds
from segnode.storage.ledger import LedgerInUse
from segnode.storage.migrations import SchemaError

log = logging.getLogger("segnode")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="configuration file (default: built-in defaults)")
    p.add_argument("--data-dir", type=Path, help="data directory (ledger, spool, results)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    parser = argparse.ArgumentParser(prog="segnode", description=__doc__)
    parser.add_argument("--version", action="version", version=f"segnode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the node in the foreground (logs to stdout)")
    _common(p)
    p.add_argument("--port", type=int)
    p.add_argument("--host", help="address to bind (config node.host)")
    p.add_argument("--ae-title")
    p.add_argument(
        "--send-to",
        action="append",
        default=[],
        metavar="AE@HOST:PORT",
        help="add a result destination (repeatable)",
    )

    p = sub.add_parser("echo", help="C-ECHO a DICOM peer")
    _common(p)
    p.add_argument("peer", metavar="AE@HOST:PORT")

    p = sub.add_parser("send", help="C-STORE DICOM files or folders to a peer")
    _common(p)
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--to", required=True, metavar="AE@HOST:PORT")

    p = sub.add_parser("jobs", help="recent jobs with state and per-stage times")
    _common(p)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("status", help="counts of instances, jobs and deliveries")
    _common(p)

    p = sub.add_parser("retry", help="requeue a failed job (same result UIDs)")
    _common(p)
    p.add_argument("job", type=int, nargs="?")
    p.add_argument(
        "--failed", action="store_true", help="requeue every failed job (latest series versions)"
    )

    p = sub.add_parser("cancel", help="cancel a queued or unsent job")
    _common(p)
    p.add_argument("job", type=int)

    p = sub.add_parser("db", help="the ledger's schema: create or upgrade it, show it")
    db = p.add_subparsers(dest="db_command", required=True)
    p = db.add_parser(
        "upgrade",
        help="create the ledger or bring its schema to this segnode's (run once, from one node)",
    )
    _common(p)
    p = db.add_parser("current", help="the ledger's schema revision and this segnode's")
    _common(p)

    p = sub.add_parser("rules", help="routing rules")
    rules = p.add_subparsers(dest="rules_command", required=True)
    p = rules.add_parser(
        "test", help="dry run: what the rules do with each series under PATH (nothing is sent)"
    )
    _common(p)
    p.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    p.add_argument(
        "--calling-ae", default="", metavar="AE", help="calling AE title the series come from"
    )

    try:
        from segnode.engines.engine_cli import add_engine_parser
    except ImportError:
        pass
    else:
        engine = add_engine_parser(sub)
        for action in engine._actions:  # --config/--data-dir on `engine build` and `engine list`
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    _common(child)

    try:
        from segnode.engines.importers.cli import add_model_parser
    except ImportError:
        pass
    else:
        add_model_parser(sub)
    return parser


def _config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config)
    return cfg.with_overrides(data_dir=args.data_dir)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    # pynetdicom (the outbox's SCU) logs every PDU at INFO/DEBUG: keep its warnings only.
    logging.getLogger("pynetdicom").setLevel(logging.WARNING)
    logging.getLogger("highdicom").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its per-migration lines


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the node until SIGTERM/SIGINT."""
    from segnode.engines.base import EngineError
    from segnode.node.ops.service import Node

    cfg = load_config(args.config).with_overrides(
        port=args.port,
        ae_title=args.ae_title,
        data_dir=args.data_dir,
        send_to=args.send_to,
        host=args.host,
    )
    _setup_logging(cfg.log_level)
    os.umask(0o077)  # spool, results and ledger hold patient data: private to the service user
    try:
        node = Node(cfg)
    except EngineError as exc:  # a model that cannot be read, loaded or run
        raise SegnodeError(f"cannot start: {exc}") from exc
    node.install_signal_handlers()
    try:
        node.start()
    except OSError as exc:
        node.shutdown()
        raise SegnodeError(f"cannot listen on {cfg.node.host}:{cfg.node.port}: {exc}") from exc
    except SegnodeError:
        node.shutdown()
        raise
    node.run_forever()
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    """``segnode db upgrade`` / ``segnode db current``."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from segnode.node.ops.service import make_data_dir
    from segnode.storage import migrations

    cfg = _config(args)
    url, where = ledger_url(cfg)
    if args.db_command == "upgrade":
        if url.startswith("sqlite"):
            make_data_dir(cfg.data_dir)  # a file in its place: a configuration error
            os.umask(0o077)
        found = migrations.upgrade_database(url)
        if found.alembic == migrations.HEAD:
            print(f"ledger {where}: schema {migrations.HEAD}, current; nothing to do")
        else:
            was = "empty" if found.empty else f"schema {found.alembic or found.version}"
            print(f"ledger {where}: was {was}, now schema {migrations.HEAD}")
        return 0
    if url.startswith("sqlite") and not (cfg.data_dir / "ledger.sqlite").exists():
        print(f"ledger {where}: none yet; this segnode: schema {migrations.HEAD}")
        return 1
    engine = create_engine(url, poolclass=NullPool)
    try:
        found = migrations.revision(engine)
    finally:
        engine.dispose()
    has = "empty" if found.empty else f"schema {found.alembic or found.version}"
    print(f"ledger {where}: {has}; this segnode: schema {migrations.HEAD}")
    return 0 if found.alembic == migrations.HEAD else 1


def ledger_url(cfg: Config) -> tuple[str, str]:
    """The configured ledger's URL and how messages name it (no password)."""
    from sqlalchemy import make_url

    url = cfg.ledger.url or f"sqlite:///{(cfg.data_dir / 'ledger.sqlite').absolute()}"
    return url, make_url(url).render_as_string(hide_password=True)


def cmd_echo(args: argparse.Namespace) -> int:
    """C-ECHO a peer."""
    from segnode.node.outbox.scu import echo

    cfg = _config(args)
    peer = parse_peer(args.peer, "peer")
    status = echo(peer, cfg.dispatch.calling_ae)
    if status == 0:
        print(f"C-ECHO {peer.name}: success")
        return 0
    print(f"C-ECHO {peer.name}: " + ("no association" if status < 0 else f"status 0x{status:04X}"))
    return 1


def iter_dicom_files(paths: Sequence[Path]) -> Iterator[Path]:
    """Files under ``paths`` that are DICOM by content (PS3.10 preamble), any name."""
    for root in paths:
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        for f in files:
            if f.is_file():
                try:
                    with f.open("rb") as fh:
                        head = fh.read(132)
                except OSError:
                    continue
                if head[128:132] == b"DICM":
                    yield f


def cmd_send(args: argparse.Namespace) -> int:
    """C-STORE files to a peer."""
    from pydicom import dcmread
    from pynetdicom import AE

    cfg = _config(args)
    peer = parse_peer(args.to, "--to")
    files = list(iter_dicom_files(args.paths))
    if not files:
        print("no DICOM files found")
        return 1
    contexts: set[tuple[str, str]] = set()
    for f in files:
        meta = dcmread(f, stop_before_pixels=True, specific_tags=[]).file_meta
        contexts.add((str(meta.MediaStorageSOPClassUID), str(meta.TransferSyntaxUID)))
    ae = AE(ae_title=cfg.dispatch.calling_ae)
    for cls, ts in sorted(contexts)[:128]:
        ae.add_requested_context(cls, ts)
    assoc = ae.associate(peer.host, peer.port, ae_title=peer.ae_title)
    if not assoc.is_established:
        print(f"cannot associate with {peer.name}")
        return 1
    ok = failed = 0
    try:
        for f in files:
            status = assoc.send_c_store(f)
            code = int(status.Status) if status else -1
            if code == 0:
                ok += 1
            else:
                failed += 1
                print(f"{f}: " + ("no response" if code < 0 else f"status 0x{code:04X}"))
    finally:
        if assoc.is_established:
            assoc.release()
    print(
        f"sent {ok} of {len(files)} file(s) to {peer.name}"
        + (f", {failed} failed" if failed else "")
    )
    return 0 if failed == 0 else 1


def _fmt_stage(stages: dict[str, datetime | None]) -> str:
    last = stages.get("last_instance")
    parts = []
    for key in ("queued", "volume", "inference", "encoded", "sending", "finished"):
        t = stages.get(key)
        if t is not None and last is not None:
            parts.append(f"{key} +{(t - last).total_seconds():.2f}s")
    return ", ".join(parts)


def cmd_jobs(args: argparse.Namespace) -> int:
    """Print recent jobs and ignored series."""
    from segnode.node.ops.service import open_state

    cfg = _config(args)
    ledger, _ = open_state(cfg, create=False)
    try:
        if args.json:
            print(json.dumps(jobs_facts(ledger, args.limit), indent=2))
            return 0
        jobs = ledger.jobs(args.limit)
        ignored = ledger.ignored_series(args.limit)
        waiting = ledger.held_series(args.limit)
    finally:
        ledger.close()
    print(
        f"{'JOB':>5} {'STATE':<10} {'VER':>3} {'N':>5} {'TRIGGER':<20} "
        "SERIES / TIMES (after last instance)"
    )
    for j in jobs:
        print(
            f"{j.id:>5} {j.state:<10} {j.version:>3} {j.instance_count:>5} {j.trigger:<20} "
            f"{j.series_instance_uid}"
        )
        if j.rule:
            print(f"{'':>47}rule {j.rule}, model {j.model_name} ({j.model} on {j.engine})")
        if cfg.ledger.url and j.owner:  # a shared ledger: which node ran it
            print(f"{'':>47}node {j.owner}")
        times = _fmt_stage(j.stages)
        if times:
            print(f"{'':>47}{times}")
        if j.reason:
            print(f"{'':>47}reason: {j.reason}")
        if j.superseded_by is not None:
            print(f"{'':>47}results superseded by job {j.superseded_by} (a later version)")
        errors = j.delivery_errors or (None,) * len(j.deliveries)
        acks = j.delivery_acks or (None,) * len(j.deliveries)
        starts = j.delivery_starts or (None,) * len(j.deliveries)
        last_in = j.stages.get("last_instance")
        for (kind, dest, status, attempts), err, start, ack in zip(
            j.deliveries, errors, starts, acks, strict=False
        ):
            # A sent delivery's "error" is the warning it was stored with.
            last = "" if not err else f"; {err}" if status == "sent" else f"; last error: {err}"
            acked = f", acked +{(ack - last_in).total_seconds():.2f}s" if ack and last_in else ""
            took = send_seconds(start, ack) if status == "sent" else None
            sent_in = f" in {took:.2f}s" if took is not None else ""
            print(
                f"{'':>47}{kind} -> {dest}: {status} ({attempts} attempt(s)){acked}{sent_in}{last}"
            )
    if waiting:
        print("\nSERIES WAITING FOR MORE INSTANCES (no job yet)")
        for uid, n, reason, _since in waiting:
            print(f"  {uid}: {n} instance(s)" + (f"; {reason}" if reason else ""))
    if ignored:
        print("\nIGNORED SERIES")
        for uid, ae, reason in ignored:
            print(f"  {uid} from {ae}: {reason}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print ledger counts."""
    from segnode.node.ops.service import open_state

    cfg = _config(args)
    ledger, _ = open_state(cfg, create=False)
    try:
        facts = ledger_status(ledger, cfg.series.quiet_period_s)
    finally:
        ledger.close()
    from segnode.node.audit.trail import queue_facts

    facts["audit"] = queue_facts(cfg)
    from segnode.node.ops.gpu import gpu_busy_percent

    # the GPU's utilisation now (NVML; null without NVML or an NVIDIA GPU): device-wide, so
    # it needs no running node; the node's own figures are in /api/v1/status
    facts["gpu_busy_pct"] = gpu_busy_percent()
    print(json.dumps({"data_dir": str(cfg.data_dir), **facts}, indent=2))
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    """Requeue a job, or every failed job with ``--failed``."""
    from segnode.node.audit.trail import record_command
    from segnode.node.ops.service import node_name, open_state

    if (args.job is None) == (not args.failed):
        print("segnode retry: give either a JOB id or --failed", file=sys.stderr)
        return 2
    cfg = _config(args)
    ledger, _ = open_state(cfg, create=False)
    try:
        if args.failed:
            ids = [j for j in ledger.failed_jobs() if ledger.retry_job(j)]
            print(f"requeued {len(ids)} failed job(s)" + (f": {ids}" if ids else ""))
            what = f"retry --failed: {len(ids)} job(s) requeued {ids}"
            record_command(cfg, node_name(cfg), "retry", what)
            return 0
        ok = ledger.retry_job(args.job)
    finally:
        ledger.close()
    what = f"job {args.job}: retry: {'done' if ok else 'refused'}"
    record_command(cfg, node_name(cfg), "retry", what)
    print(
        f"job {args.job} "
        + ("requeued" if ok else "is not failed or cancelled (or does not exist)")
    )
    return 0 if ok else 1


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel a job."""
    from segnode.node.audit.trail import record_command
    from segnode.node.ops.service import node_name, open_state

    cfg = _config(args)
    ledger, _ = open_state(cfg, create=False)
    try:
        ok = ledger.cancel_job(args.job)
    finally:
        ledger.close()
    what = f"job {args.job}: cancel: {'done' if ok else 'refused'}"
    record_command(cfg, node_name(cfg), "cancel", what)
    print(f"job {args.job} " + ("cancelled" if ok else "is not active (or does not exist)"))
    return 0 if ok else 1


def cmd_rules(args: argparse.Namespace) -> int:
    """``segnode rules test``: the routing decision for each series of the files given."""
    from segnode.engines.base import EngineError
    from segnode.node.modelspec import load_spec_manifest
    from segnode.node.routing.rules import Router, dry_run, model_specs, senders_from_peers

    cfg = _config(args)
    specs = {s.name: s for s in model_specs(cfg)}

    def describe(name: str) -> str:
        spec = specs[name]
        try:
            m = load_spec_manifest(spec)
        except EngineError as exc:
            return f"manifest unreadable: {exc}"
        return f"{m.name} {m.version} on {spec.engine}"

    router = Router(
        cfg.routing,
        cfg.dispatch.destinations,
        senders_from_peers(cfg.node.peers),
        lambda ae: cfg.series.policy_for(ae).priority,
    )
    files = list(iter_dicom_files(args.paths))
    if not files:
        print("no DICOM files found")
        return 1
    nc, calling = cfg.node, args.calling_ae.strip()
    known = {*nc.allowed_calling_aes, *(p.ae_title for p in nc.peers)}
    if calling and known and calling not in known:
        print(
            f"note: calling AE {calling!r} is in neither node.allowed_calling_aes nor "
            "[[node.peers]]: the node would refuse its associations"
        )
    for line in dry_run(
        files,
        router,
        calling_ae=args.calling_ae.strip(),
        describe_model=describe,
        other_sop_classes=cfg.node.other_sop_classes,
    ):
        print(line)
    return 0


COMMANDS = {
    "serve": cmd_serve,
    "echo": cmd_echo,
    "send": cmd_send,
    "jobs": cmd_jobs,
    "status": cmd_status,
    "retry": cmd_retry,
    "cancel": cmd_cancel,
    "rules": cmd_rules,
    "db": cmd_db,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``segnode`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (``segnode jobs | head``): exit quietly, as Unix tools do.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 1


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
        if args.command == "model":
            from segnode.engines.importers.cli import run_model_command

            return run_model_command(args)
        from segnode.engines.engine_cli import Configured, run_engine_command
        from segnode.node.routing.rules import model_specs

        cfg = _config(args)
        configured = {
            m.name: Configured(m.manifest, m.engine, m.precision) for m in model_specs(cfg)
        }
        return run_engine_command(
            args, data_dir=cfg.data_dir, default_model=cfg.model.manifest, configured=configured
        )
    except ConfigError as exc:
        print(f"segnode: configuration error: {exc}", file=sys.stderr)
        return 2
    except SegnodeError as exc:
        print(f"segnode: {exc}", file=sys.stderr)
        return 1
    except (SchemaError, LedgerInUse) as exc:
        print(f"segnode: cannot open the ledger: {exc}", file=sys.stderr)
        return 1
    except OperationalError as exc:  # the ledger's database cannot be reached
        print(f"segnode: cannot reach the ledger: {exc.orig or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
