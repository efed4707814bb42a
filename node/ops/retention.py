"""Retention: delete spooled instances (and sent results) of delivered series after N days.

``retention.spool_days = 0`` (the default) keeps everything. Otherwise, once the latest job of
a series has been ``sent`` (every result delivered) or ``done`` for that many days and nothing
of the series is pending, its spooled instance files are deleted, and so are the result files
of its ``sent`` jobs (results of ``done`` jobs are the node's output when it has no
destination, so they stay). The ledger keeps every row, so ``segnode jobs`` still shows the
history; each purge is a ``spool_purges`` row and a ``retention`` event. A job retried after
its series was purged fails with "spooled instance files are missing".
"""

from __future__ import annotations

import logging
import shutil
import time
from datetime import timedelta
from pathlib import Path

from segnode.node.audit.trail import AuditTrail, StudyFacts
from segnode.node.config import Config
from segnode.storage.ledger import Ledger, PurgeCandidate, utcnow

log = logging.getLogger(__name__)


class Retention:
    """Deletes files of delivered series; :meth:`maybe_run` is called from the main loop.

    Parameters
    ----------
    config, ledger
        Node configuration and durable state.
    audit
        The audit trail: each purge is a DICOM Study Deleted (off when None).
    """

    def __init__(self, config: Config, ledger: Ledger, audit: AuditTrail | None = None) -> None:
        self.audit = audit or AuditTrail.off()
        self.days = config.retention.spool_days
        self.interval = config.retention.check_interval_s
        self.spool_root = config.data_dir / "spool"
        self.results_root = config.data_dir / "results"
        self.ledger = ledger
        self._last = -1e18

    @property
    def enabled(self) -> bool:
        """Whether retention deletes anything."""
        return self.days > 0

    def maybe_run(self) -> int:
        """Run :meth:`run_once` if the check interval has passed; return files deleted."""
        if not self.enabled or time.monotonic() - self._last < self.interval:
            return 0
        self._last = time.monotonic()
        try:
            return self.run_once()
        except Exception:  # a retention failure must not stop the node
            log.exception("retention pass failed")
            return 0

    def run_once(self, batch: int = 50) -> int:
        """Purge every eligible series now; return the number of files deleted."""
        cutoff = utcnow() - timedelta(days=self.days)
        total = 0
        while True:
            candidates = self.ledger.purge_candidates(cutoff, limit=batch)
            if not candidates:
                break
            for c in candidates:
                total += self._purge(c)
            if len(candidates) < batch:
                break
        if total:
            log.info("retention: deleted %d file(s) of delivered series", total)
        return total

    def _inside(self, path: Path, root: Path) -> bool:
        try:
            path.resolve().relative_to(root.resolve())
        except ValueError:
            return False
        return True

    def _purge(self, c: PurgeCandidate) -> int:
        files = size = 0
        folders: set[Path] = set()
        # Who and what it was, read before the files go (an audit message names them).
        facts = None
        if self.audit.enabled:
            for text in c.instance_paths:
                if Path(text).is_file() and (facts := StudyFacts.of_file(text)) is not None:
                    break
        for text in c.instance_paths:
            p = Path(text)
            if not self._inside(p, self.spool_root):
                continue
            try:
                size += p.stat().st_size
                p.unlink()
                files += 1
            except FileNotFoundError:
                continue
            folders.add(p.parent)
        for folder in folders:  # series folder, then its study folder, if now empty
            for d in (folder, folder.parent):
                if d != self.spool_root:
                    try:
                        d.rmdir()
                    except OSError:
                        break
        for job_id in c.sent_job_ids:
            out = self.results_root / str(job_id)
            if out.is_dir():
                for f in out.iterdir():
                    size += f.stat().st_size
                    files += 1
                shutil.rmtree(out, ignore_errors=True)
        self.ledger.record_purge(c.series_id, files, size)
        if files:
            self.audit.deleted(
                facts,
                len(c.instance_paths),
                f"retention: series {c.series_instance_uid} delivered more than {self.days:g} "
                f"day(s) ago; its {files} file(s) deleted",
            )
        return files
