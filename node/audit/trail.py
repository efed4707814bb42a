"""The node's audit trail: what happened, turned into DICOM audit messages.

:class:`AuditTrail` is the one object the node's parts tell of auditable events (the SCP, the
acceptor, the outbox, retention, the console, the service). It knows the node's identity
(:class:`~segnode.node.audit.messages.NodeIdentity`), builds the message of each event
(:mod:`segnode.node.audit.messages`) and hands it to the
:class:`~segnode.node.audit.auditor.Auditor`, which keeps it in its durable queue and sends it.
With ``[audit] enabled = false`` (the default) every method returns at once.

Three rules shape it:

* **Nothing on the wire waits for it.** Instances received are counted in memory per
  association and series; the message goes when the association ends (DICOM Instances
  Transferred is per study, PS3.15 A.5.3.7; the node sends one per series and association).
  A refusal or a cut-off peer is told from the acceptor's selector thread, which must not
  block: those messages are made on a thread of this trail.
* **A flood is one message per interval.** A host that is refused or cut off again and again
  gives one Security Alert per (kind, address) every ``interval`` seconds; the next one says
  how many were left out (so does :meth:`stop` for the last interval).
* **It never fails its caller.** A message that cannot be made is logged, and the node goes
  on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from segnode.node.audit import messages as m
from segnode.node.audit.auditor import Auditor, AuditSettings, NullAuditor

if TYPE_CHECKING:
    from segnode.node.config import Config

log = logging.getLogger(__name__)

#: The user named as the console's requestor: it knows a bearer token, not a person.
CONSOLE_USER = "segnode-console (bearer token)"


@dataclass
class _Received:
    """One series' instances received on one association."""

    calling_ae: str
    address: str
    patient_id: str
    patient_name: str | None
    study_uid: str
    sop_classes: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class StudyFacts:
    """Who and what a set of instances is about, as an audit message names them."""

    patient_id: str
    patient_name: str | None
    study_uid: str
    sop_class_uid: str

    @classmethod
    def of_file(cls, path: Path | str) -> StudyFacts | None:
        """Read from a DICOM file's header (None when it cannot be read)."""
        import pydicom

        try:
            ds = pydicom.dcmread(
                path,
                stop_before_pixels=True,
                specific_tags=["PatientID", "PatientName", "StudyInstanceUID", "SOPClassUID"],
            )
        except Exception as exc:  # an unreadable file: the message names no patient
            log.warning("audit: cannot read %s: %s", Path(path).name, exc)
            return None
        return cls.of_dataset(ds)

    @classmethod
    def of_dataset(cls, ds: Any) -> StudyFacts:
        """Read from a pydicom dataset (a header is enough)."""
        name = str(ds.get("PatientName", "") or "") or None
        return cls(
            patient_id=str(ds.get("PatientID", "") or "") or "(no Patient ID)",
            patient_name=name,
            study_uid=str(ds.get("StudyInstanceUID", "") or ""),
            sop_class_uid=str(ds.get("SOPClassUID", "") or ""),
        )


def node_identity(config: Config, name: str) -> m.NodeIdentity:
    """The node as its audit messages name it: ``[audit] source_id``, else ``name`` (the
    node's name in the ledger), is its AuditSourceID."""
    host_name = socket.gethostname()
    address = config.node.host
    if address in ("0.0.0.0", "::", ""):
        try:
            address = socket.gethostbyname(host_name)
        except OSError:
            address = host_name
    return m.NodeIdentity(
        ae_title=config.node.ae_title,
        host_name=host_name,
        address=address,
        process_id=str(os.getpid()),
        source_id=config.audit.source_id or name,
        enterprise_site=config.audit.enterprise_site or None,
    )


def settings_of(config: Config) -> AuditSettings:
    """The :class:`AuditSettings` of ``[audit]``."""
    a = config.audit
    return AuditSettings(
        enabled=a.enabled,
        destinations=a.destinations,
        max_queued=a.max_queued,
        on_full=a.on_full,
        tls_ca=a.ca_file,
        tls_cert=a.cert_file,
        tls_key=a.key_file,
        source_id=a.source_id,
        enterprise_site=a.enterprise_site,
    )


class SentBatch:
    """One outbox pass's outcomes to one destination, per job: :meth:`close` tells the trail
    (one DICOM Instances Transferred per job and destination, :meth:`AuditTrail.sent`)."""

    def __init__(self, trail: AuditTrail, peer_ae: str, peer_address: str) -> None:
        self.trail = trail
        self.peer_ae, self.peer_address = peer_ae, peer_address
        # job id -> (a result file, SOP classes accepted or tried, failures)
        self._jobs: dict[int, tuple[str, Counter[str], list[str]]] = {}

    def add(self, job_id: int, path: str, sop_class: str, failure: str | None) -> None:
        """A result object of ``job_id`` was sent (``failure`` None) or failed with why."""
        if not self.trail.enabled:
            return
        _path, classes, failures = self._jobs.setdefault(job_id, (path, Counter(), []))
        if failure is None:
            classes[sop_class] += 1
        else:
            classes[sop_class] += 0  # named, with no instance accepted
            failures.append(failure)

    def close(self) -> None:
        """Tell the trail, one message per job (the files read for the patient and study)."""
        jobs, self._jobs = self._jobs, {}
        for path, classes, failures in jobs.values():
            self.trail.sent(
                peer_ae=self.peer_ae,
                peer_address=self.peer_address,
                facts=StudyFacts.of_file(path),
                sop_classes=classes,
                failures=failures,
            )


class AuditTrail:
    """Auditable events in, DICOM audit messages out (see the module's docstring).

    Parameters
    ----------
    auditor
        Keeps and sends the messages (:class:`NullAuditor`: auditing is off).
    node
        The node's identity in the messages; None only when auditing is off.
    interval
        Seconds between two Security Alerts of one kind for one address.
    """

    def __init__(
        self,
        auditor: Auditor | NullAuditor,
        node: m.NodeIdentity | None,
        *,
        interval: float = 10.0,
    ) -> None:
        self.auditor = auditor
        self.node = node
        self.interval = interval
        self.enabled = node is not None and not isinstance(auditor, NullAuditor)
        self._lock = threading.Lock()
        self._received: dict[tuple[int, str], _Received] = {}
        # (kind, address) -> (when last sent, how many left out since)
        self._alerts: dict[tuple[str, str], tuple[float, int]] = {}
        self._later: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._started = False

    @classmethod
    def off(cls) -> AuditTrail:
        """A trail that records nothing (``[audit] enabled = false``)."""
        return cls(NullAuditor(), None)

    @classmethod
    def from_config(cls, config: Config, name: str) -> AuditTrail:
        """The trail ``[audit]`` asks for (off unless ``enabled``) for the node ``name``."""
        if not config.audit.enabled:
            return cls.off()
        return cls(Auditor(settings_of(config), config.data_dir), node_identity(config, name))

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Open the durable queue and start sending (and this trail's own thread)."""
        if not self.enabled:
            return
        self.auditor.start()
        self._started = True
        self._thread = threading.Thread(target=self._run_later, name="audit-trail", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Make what is left (the last interval's counts of left-out alerts), then stop the
        auditor (it sends what it can within ``timeout``)."""
        if not self.enabled or not self._started:
            return
        self._started = False
        if self._thread is not None:
            self._later.put(None)
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            left = [(k, n) for k, (_, n) in self._alerts.items() if n]
            self._alerts.clear()
        for (kind, address), n in left:
            self._emit(partial(self._left_out, kind, address, n))
        self.auditor.stop(timeout)

    def admits(self) -> bool:
        """False while the queue is full and ``[audit] on_full = "refuse"``."""
        return not self.enabled or self.auditor.admits()

    def status(self) -> dict[str, Any]:
        """The auditor's figures (``segnode status``); ``{"enabled": False}`` when off."""
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, **self.auditor.status()}

    # -- the node ------------------------------------------------------------------------

    def started(self, config: Config) -> None:
        """Application Start, then the configuration loaded (Security Alert, Software
        Configuration) with its digest and whether it changed since the last start."""
        if not self.enabled:
            return
        self._emit(lambda: m.application_activity(self._node, started=True, user=_os_user()))
        digest = hashlib.sha256(repr(config).encode()).hexdigest()
        marker = config.data_dir / "audit-config.sha256"
        try:
            before = marker.read_text().strip()
        except OSError:
            before = ""
        if not before:
            change = "first start with auditing"
        elif before == digest:
            change = "unchanged since the last start"
        else:
            change = "changed since the last start"
        self._emit(
            lambda: m.security_alert(
                self._node,
                kind="software_configuration",
                user=_os_user(),
                address=None,
                description=f"configuration loaded (sha256 {digest[:16]}): {change}",
            )
        )
        try:
            marker.write_text(digest + "\n")
        except OSError as exc:
            log.warning("audit: cannot keep the configuration's digest: %s", exc)

    def stopped(self) -> None:
        """Application Stop."""
        if self.enabled and self._started:
            self._emit(lambda: m.application_activity(self._node, started=False, user=_os_user()))

    # -- associations (the acceptor's notices and the SCP) ---------------------------------

    def refused(self, calling_ae: str, address: str, reason: str) -> None:
        """An association was refused (A-ASSOCIATE-RJ sent). From the selector thread."""
        if self.enabled and self._alert_due("refusal", address):
            self._later.put(
                lambda: self._emit(
                    lambda: m.association_refused(
                        self._node, calling_ae=calling_ae, address=address, reason=reason
                    )
                )
            )

    def cut_off(self, calling_ae: str, address: str, reason: str) -> None:
        """The node aborted or closed a peer for what it did (a timeout, a malformed or
        oversized PDU, a pending-connection limit). May come from the selector thread."""
        if self.enabled and self._alert_due("cut-off", address):
            self._later.put(
                lambda: self._emit(
                    lambda: m.security_alert(
                        self._node,
                        kind="node_authentication",
                        user=calling_ae or None,
                        address=address,
                        description=f"peer at {address} cut off: {reason}",
                        outcome=m.MINOR_FAILURE,
                    )
                )
            )

    def received(
        self, assoc_id: int, calling_ae: str, address: str, series_uid: str, header: Any
    ) -> None:
        """A CT instance was stored: counted for its association and series (after its
        response went: the SCP calls this as a follow-up)."""
        if not self.enabled or header is None:
            return
        key = (assoc_id, series_uid)
        with self._lock:
            seen = self._received.get(key)
            if seen is None:
                facts = StudyFacts.of_dataset(header)
                seen = self._received[key] = _Received(
                    calling_ae, address, facts.patient_id, facts.patient_name, facts.study_uid
                )
            seen.sop_classes[str(header.get("SOPClassUID", "") or "")] += 1

    def association_closed(self, assoc_id: int) -> None:
        """One DICOM Instances Transferred (in) per series the association delivered."""
        if not self.enabled:
            return
        with self._lock:
            keys = [k for k in self._received if k[0] == assoc_id]
            done = [self._received.pop(k) for k in keys]
        for r in done:
            self._emit(
                partial(
                    m.instances_transferred,
                    self._node,
                    direction="in",
                    peer_ae=r.calling_ae,
                    peer_address=r.address,
                    patient_id=r.patient_id,
                    patient_name=r.patient_name,
                    study_uid=r.study_uid,
                    sop_classes=dict(r.sop_classes),
                )
            )

    # -- results, retention, the console ---------------------------------------------------

    def sent(
        self,
        *,
        peer_ae: str,
        peer_address: str,
        facts: StudyFacts | None,
        sop_classes: Mapping[str, int],
        failures: list[str],
    ) -> None:
        """One job's results to one destination in one pass: DICOM Instances Transferred
        (out), success when every object was accepted, else a minor failure naming why."""
        if not self.enabled:
            return
        f = facts or StudyFacts("(unknown)", None, "(unknown)", "")
        outcome = m.SUCCESS if not failures else m.MINOR_FAILURE
        self._emit(
            lambda: m.instances_transferred(
                self._node,
                direction="out",
                peer_ae=peer_ae,
                peer_address=peer_address,
                patient_id=f.patient_id,
                patient_name=f.patient_name,
                study_uid=f.study_uid,
                sop_classes=dict(sop_classes),
                outcome=outcome,
                description="; ".join(failures)[:1000] if failures else None,
            )
        )

    def batch(self, peer_ae: str, peer_address: str) -> SentBatch:
        """A :class:`SentBatch` for one outbox pass to one destination."""
        return SentBatch(self, peer_ae, peer_address)

    def deleted(self, facts: StudyFacts | None, count: int, reason: str) -> None:
        """Retention deleted a series' instances (and its results): DICOM Study Deleted."""
        if not self.enabled or facts is None:
            return
        self._emit(
            lambda: m.study_deleted(
                self._node,
                patient_id=facts.patient_id,
                patient_name=facts.patient_name,
                study_uid=facts.study_uid,
                sop_classes={facts.sop_class_uid or "(unknown)": count},
                reason=reason,
            )
        )

    def console_action(self, action: str, job_id: int, address: str, outcome: str) -> None:
        """A console or API action (retry, cancel) done with the token: Security Alert, Use
        of Restricted Function."""
        if self.enabled:
            self._emit(
                lambda: m.security_alert(
                    self._node,
                    kind="restricted_function",
                    user=CONSOLE_USER,
                    address=address,
                    description=f"job {job_id}: {action}: {outcome}",
                )
            )

    def auth_failure(self, address: str, what: str) -> None:
        """A console or API request without the right bearer token: User Authentication,
        failed (rate-limited per address like the alerts)."""
        if self.enabled and self._alert_due("authentication", address):
            self._emit(
                lambda: m.user_authentication(
                    self._node,
                    user=CONSOLE_USER,
                    address=address,
                    success=False,
                    description=what,
                )
            )

    # -- internals -----------------------------------------------------------------------

    @property
    def _node(self) -> m.NodeIdentity:
        assert self.node is not None
        return self.node

    def _alert_due(self, kind: str, address: str) -> bool:
        """Whether an alert of ``kind`` for ``address`` goes now (else it is counted)."""
        now = time.monotonic()
        key = (kind, address)
        with self._lock:
            last, left_out = self._alerts.get(key, (-1e18, 0))
            if now - last < self.interval:
                self._alerts[key] = (last, left_out + 1)
                return False
            if len(self._alerts) > 4096:  # a flood from many addresses: forget the old ones
                self._alerts = {k: v for k, v in self._alerts.items() if now - v[0] < self.interval}
            self._alerts[key] = (now, 0)
        if left_out:
            self._later.put(lambda: self._emit(partial(self._left_out, kind, address, left_out)))
        return True

    def _left_out(self, kind: str, address: str, n: int) -> m.AuditMessage:
        """The Security Alert that counts the alerts of an interval that were not sent."""
        return m.security_alert(
            self._node,
            kind="node_authentication",
            user=None,
            address=address,
            description=f"{n} more {kind} of {address} in the last {self.interval:.0f} s",
            outcome=m.MINOR_FAILURE,
        )

    def _emit(self, make: Callable[[], m.AuditMessage]) -> None:
        try:
            self.auditor.emit(make())
        except Exception:  # the node goes on; the log says what was not audited
            log.exception("audit: a message could not be made")

    def _run_later(self) -> None:
        while (job := self._later.get()) is not None:
            job()


def record_command(config: Config, node: str, name: str, description: str) -> None:
    """A command-line action on the ledger (``segnode retry``, ``segnode cancel``): a Security
    Alert, Use of Restricted Function, by the OS user, put in the node's audit queue. The
    running node's senders look at the queue every few seconds and send it; a stopped node
    sends it at its next start. ``node`` is the node's name (AuditSourceID unless
    ``[audit] source_id``). Nothing when ``[audit]`` is off; never raises."""
    if not config.audit.enabled:
        return
    try:
        auditor = Auditor(settings_of(config), config.data_dir)
    except Exception as exc:  # the command's change is made; say what was not audited
        log.error("audit: cannot open the audit queue: %s", exc)
        return
    try:
        auditor.emit(
            m.security_alert(
                node_identity(config, node),
                kind="restricted_function",
                user=f"{_os_user()} (segnode {name})",
                address=None,
                description=description,
            )
        )
    finally:
        auditor.queue.close()


def queue_facts(config: Config) -> dict[str, Any]:
    """What ``segnode status`` says of the audit queue, read from ``audit.sqlite`` without
    the node: messages waiting per destination, and the oldest one's age."""
    if not config.audit.enabled:
        return {"enabled": False}
    path = config.data_dir / "audit.sqlite"
    if not path.exists():
        return {"enabled": True, "waiting": {}}
    import sqlite3

    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            rows = db.execute(
                "SELECT c.destination, COUNT(m.seq), MIN(m.created) FROM cursors c "
                "LEFT JOIN messages m ON m.seq > c.last_seq GROUP BY c.destination"
            ).fetchall()
    except sqlite3.Error as exc:
        return {"enabled": True, "error": str(exc)}
    now = time.time()
    return {
        "enabled": True,
        "waiting": {
            dest: {"messages": n, "oldest_s": round(now - oldest, 1) if oldest else None}
            for dest, n, oldest in rows
        },
    }


def _os_user() -> str:
    """The operating-system user the node runs as (the Application Launcher)."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())
