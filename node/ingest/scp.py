"""The Storage SCP: accept, write, record, reply.

The transport is :mod:`segnode.node.dicom.ul`, a blocking, non-polling Upper Layer acceptor (one
thread per
association). The C-STORE handler follows pynetdicom's ``apps/common.py:handle_store`` shape:
it never decodes pixels and never waits for inference. It validates the request, parses the
elements before Pixel Data, writes the bytes as received to the spool atomically, records the
instance in the ledger, and only then answers 0x0000. Failures map to statuses (PS3.4
§B.2.3) with an Error Comment (0000,0902) saying why: 0xA700 out of resources (disk, ledger,
a deflated dataset inflating past the instance limit), 0xA900 data set does not match the
request or its SOP class, 0xC210-0xC212 cannot understand.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from pydicom import dcmread
from pydicom.errors import InvalidDicomError
from pydicom.uid import UID
from pynetdicom import ALL_TRANSFER_SYNTAXES
from pynetdicom.presentation import AllStoragePresentationContexts
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    Verification,
)

from segnode.node.audit.trail import AuditTrail
from segnode.node.config import Config, NodeConfig
from segnode.node.dicom import tls
from segnode.node.dicom.guards import AccessPolicy, DiskGuard, SeriesBudget
from segnode.node.dicom.header import Header, HeaderError, InflateLimitError, parse_header
from segnode.node.dicom.ul import (
    IMPLEMENTATION_CLASS_UID,
    IMPLEMENTATION_VERSION,
    Acceptor,
    AcceptorOptions,
    AssociationInfo,
    FollowUp,
    StoreOutcome,
    StoreRequest,
)
from segnode.node.errors import is_ledger_outage, log_failure
from segnode.node.ingest.streaming import Arrival
from segnode.node.ingest.volume import CT_CLASSES
from segnode.storage.ledger import InstanceRecord, Ledger
from segnode.storage.spool import Spool, SpoolError, Staged, StagingFile, valid_uid

log = logging.getLogger(__name__)

OWN_MANUFACTURER = "segnode"

# Status codes (PS3.4 Annex B.2.3; PS3.7 Annex C)
SUCCESS = 0x0000
OUT_OF_RESOURCES = 0xA700
CANNOT_UNDERSTAND = 0xC210
BAD_UID = 0xC211
MISSING_ATTRIBUTE = 0xC212
SOP_MISMATCH = 0xA900

#: The maximum PDU length announced when ``node.max_pdu`` is 0 (the old "unlimited").
DEFAULT_MAX_PDU = NodeConfig.max_pdu

#: Seconds after an association ends before the staging pool is refilled.
REFILL_DELAY_S = 0.5

#: A status to answer, or a status with its Error Comment (0000,0902).
_Status = int | tuple[int, str]


def _outcome(status: _Status, after: tuple[FollowUp, ...] = ()) -> StoreOutcome:
    code, comment = status if isinstance(status, tuple) else (status, "")
    return StoreOutcome(code, comment, after)


class SeriesEvents(Protocol):
    """What the SCP tells series completion (:class:`~segnode.node.ingest.series.CompletionLoop`).

    Called from association and ``store-admit`` threads; must not block. ``touched`` is
    called before the instance's response, so it precedes the association's ``closed``.
    """

    def opened(self, assoc_id: int, calling_ae: str = "") -> None:
        """An association was accepted."""

    def touched(self, assoc_id: int, series_uid: str) -> None:
        """An association delivered (or re-sent) an instance of ``series_uid``."""

    def closed(self, assoc_id: int, *, released: bool) -> None:
        """An association ended (released normally, or aborted/dropped)."""


@dataclass(frozen=True)
class _Admitted:
    """A CT instance to keep: its ledger row is committed and its SOP Instance UID claimed."""

    rec: InstanceRecord
    header: Header
    path: Path
    #: Its row was recorded without its file (lost, or never written here): stored again.
    restored: bool = False


class StoreSCP:
    """The node's listening application entity and its service handlers.

    Parameters
    ----------
    config
        The node configuration.
    ledger, spool
        Durable state.
    tracker
        Told of every association start and end and of each series an association delivers
        (:class:`~segnode.node.ingest.series.CompletionLoop`: it only queues them).
    on_instance
        Called with every stored (durable, recorded) CT instance, after its response:
        streaming assembly and metrics; may be None.
    busy_elsewhere
        True while other work runs that a staging-pool refill must not slow down (the
        service passes "a job is running"); never when None.
    audit
        The audit trail (:class:`~segnode.node.audit.trail.AuditTrail`): told of refusals,
        peers cut off, instances stored and associations ended; off when None.

    The ``on_*`` hooks run on the association's thread as follow-ups of the C-STORE
    response (:class:`~segnode.node.dicom.ul.StoreOutcome`).
    """

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        spool: Spool,
        tracker: SeriesEvents,
        *,
        on_instance: Callable[[Arrival], None] | None = None,
        busy_elsewhere: Callable[[], bool] | None = None,
        audit: AuditTrail | None = None,
    ) -> None:
        self.config = config
        self.audit = audit or AuditTrail.off()
        self.ledger = ledger
        self.spool = spool
        self.tracker = tracker
        self.on_instance = on_instance
        self.busy_elsewhere: Callable[[], bool] = busy_elsewhere or (lambda: False)
        nc = config.node
        max_pdu = nc.max_pdu or DEFAULT_MAX_PDU
        if not nc.max_pdu:
            log.warning(
                "node.max_pdu = 0 (unlimited) is no longer honoured: a peer could make the node "
                "buffer gigabytes; announcing and enforcing %d bytes",
                max_pdu,
            )
        self.options = AcceptorOptions(
            ae_title=nc.ae_title,
            contexts=self._contexts(),
            max_pdu=max_pdu,
            acse_timeout=nc.association_request_timeout_s,
            network_timeout=nc.network_timeout_s,
            min_rate=nc.min_transfer_rate_kib_s * 1024,
            max_associations=nc.max_associations,
            max_associations_per_host=nc.max_associations_per_host,
            max_pending=nc.max_pending,
            max_pending_per_host=nc.max_pending_per_host,
            # An instance larger than a whole series may be is refused while it streams in.
            max_dataset_bytes=min(nc.max_instance_mb, nc.max_series_mb or nc.max_instance_mb)
            * 2**20,
            check_called_ae=nc.check_called_ae,
        )
        self.server: Acceptor | None = None
        self._port: int | None = None  # kept after stop() for status lines
        self.tls_server: Acceptor | None = None
        self.access = AccessPolicy(nc)
        self.disk = DiskGuard(spool.root, nc.min_free_disk_mb)
        self.budget = SeriesBudget(
            nc.max_series_instances, nc.max_series_mb * 2**20, ledger.series_totals
        )
        # Each C-STORE's header check and ledger row run here, beside its staged write: one
        # in flight per association at most.
        self._helper = ThreadPoolExecutor(nc.max_associations, thread_name_prefix="store-admit")
        # The next staged file of each association, created after its last response.
        self._ready: dict[int, StagingFile] = {}
        #: Series with an instance stored again (its row had lost its file) whose failed job
        #: is looked at after the response (:meth:`_resume`).
        self._restored: set[str] = set()
        self._claims: set[str] = set()
        self._claims_lock = threading.Lock()
        # Staging-pool refill, only while the node is quiet (see _refill_loop).
        self._refill = threading.Event()
        self._stopping = False
        self._refiller = threading.Thread(
            target=self._refill_loop, name="staging-refill", daemon=True
        )

    def _contexts(self) -> dict[str, list[str]]:
        syntaxes = [str(ts) for ts in ALL_TRANSFER_SYNTAXES]
        contexts = {str(Verification): syntaxes}
        contexts.update({uid: syntaxes for uid in sorted(CT_CLASSES)})
        if self.config.node.other_sop_classes == "ignore":
            for cx in AllStoragePresentationContexts:
                contexts.setdefault(str(cx.abstract_syntax), syntaxes)
        return contexts

    def start(self) -> None:
        """Start listening (non-blocking)."""
        nc, tc = self.config.node, self.config.tls
        ctx = tls.server_context(tc) if tc.enabled else None
        tls_only = ctx is not None and tc.port in (0, nc.port)
        self.server = self._listen(nc.port, ctx if tls_only else None)
        self._port = self.server.server_address[1]
        if ctx is not None and not tls_only:
            self.tls_server = self._listen(tc.port, ctx)
        if self.spool.pool.target and not self._refiller.is_alive():
            self._refiller.start()
        if ctx is not None:
            log.info(
                "DICOM TLS (min %s, client certificate %s) on %s:%d",
                tc.min_version,
                (
                    "not requested (no tls.ca_file)"
                    if tc.ca_file is None
                    else "required"
                    if tc.require_client_cert
                    else "optional"
                ),
                nc.host,
                self.tls_port or self.port,
            )

    def fill_staging_pool(self) -> int:
        """Write the staging pool up to its size (start-up, before listening); return how
        many files were written. Stops at the free-disk floor."""
        pool = self.spool.pool
        if not pool.target:
            return 0
        t0 = time.perf_counter()
        made = pool.fill(should_stop=lambda: not self.disk.ok(pool.file_bytes))
        if made:
            log.info(
                "staging pool: %d file(s) written in %.2f s (%d ready)",
                made,
                time.perf_counter() - t0,
                len(pool),
            )
        return made

    def _busy(self) -> bool:
        return any(
            s is not None and s.active_associations > 0 for s in (self.server, self.tls_server)
        )

    def _quiet(self) -> bool:
        return not self._busy() and not self.busy_elsewhere()

    def _refill_loop(self) -> None:
        """Refill the staging pool after associations end, once the node is quiet: no
        association active and no job running (a refill competes with a transfer for the
        disk and with inference for the CPU: measured, a refill during the job made the
        end-to-end benchmark about 1 s slower)."""
        pool = self.spool.pool
        while not self._stopping:
            self._refill.wait()
            self._refill.clear()
            while not self._stopping and len(pool) < pool.target:
                # Let a sender that opens its next association at once, and the job the
                # release queued, get in first; then wait for a quiet moment.
                time.sleep(REFILL_DELAY_S)
                if self._quiet() and self.disk.ok(pool.file_bytes):
                    pool.fill(
                        should_stop=lambda: (
                            self._stopping or not self._quiet() or not self.disk.ok(pool.file_bytes)
                        )
                    )

    def _listen(self, port: int, context: Any) -> Acceptor:
        options = replace(
            self.options,
            tls_context=context,
            handshake_timeout=self.config.tls.handshake_timeout_s,
        )
        acceptor = Acceptor(options, self)
        acceptor.start((self.config.node.host, port))
        return acceptor

    @property
    def port(self) -> int:
        """The bound port (useful when config asked for port 0); still answered after
        :meth:`stop`."""
        assert self._port is not None, "the SCP was not started"
        return self._port

    @property
    def tls_port(self) -> int | None:
        """The bound port of a separate TLS listener (``tls.port``), if any."""
        return None if self.tls_server is None else self.tls_server.server_address[1]

    def stop(self) -> None:
        """Stop accepting; idle associations are aborted at once, C-STOREs in flight get
        ``node.stop_grace_s`` to finish, then the rest are aborted (their instances were not
        acknowledged, so their senders send them again)."""
        servers = [s for s in (self.tls_server, self.server) if s is not None]
        stoppers = [
            threading.Thread(
                target=s.stop, args=(self.config.node.stop_grace_s,), name="acceptor-stop"
            )
            for s in servers
        ]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
        self.tls_server = self.server = None
        self._stopping = True
        self._refill.set()
        if self._refiller.is_alive():
            self._refiller.join(10)
        self._helper.shutdown(wait=True)
        for staging in list(self._ready.values()):
            staging.abandon()
        self._ready.clear()

    # -- association lifecycle (segnode.node.dicom.ul.Handlers)
    # ------------------------------------------

    def requested(self, info: AssociationInfo) -> tuple[int, int, int] | None:
        """A-ASSOCIATE-RQ received: check the calling AE (and host) and the disk floor.

        Rejections follow PS3.8 §9.3.4: an unknown calling AE title is a permanent rejection
        (source 1, reason 3); a full disk is transient congestion (source 3, reason 1).
        """
        if not self.access.allows(info.calling_ae, info.address):
            log.warning(
                "association from %r at %s refused: not an allowed peer",
                info.calling_ae,
                info.address,
            )
            return (0x01, 0x01, 0x03)
        if not self.disk.ok():
            log.error(
                "association from %r refused: free disk below node.min_free_disk_mb (%d MB)",
                info.calling_ae,
                self.config.node.min_free_disk_mb,
            )
            return (0x02, 0x03, 0x01)
        if not self.audit.admits():
            log.error(
                "association from %r refused: the audit queue is full (audit.on_full = "
                '"refuse"); the audit record repository must take messages first',
                info.calling_ae,
            )
            return (0x02, 0x03, 0x01)
        return None

    def refused(self, info: AssociationInfo, reason: str) -> None:
        """An A-ASSOCIATE-RJ went to the peer (the acceptor's notice): audited."""
        self.audit.refused(info.calling_ae, info.address, reason)

    def releasing(self, info: AssociationInfo, _reason: str) -> None:
        """The peer asked to release: the audit record of what it delivered is made durable
        before the A-RELEASE-RP (a sender that saw its release confirmed is audited, even if
        the node dies the next moment)."""
        self.audit.association_closed(info.id)

    def cut_off(self, info: AssociationInfo, reason: str) -> None:
        """The acceptor aborted or closed the peer for what it did: audited."""
        self.audit.cut_off(info.calling_ae, info.address, reason)

    def accepted(self, info: AssociationInfo) -> None:
        """Track the new association."""
        self.tracker.opened(info.id, info.calling_ae)
        log.info("association accepted from %s (%s:%s)", info.calling_ae, info.address, info.port)

    def closed(self, info: AssociationInfo, released: bool) -> None:
        """A normal release completes the series this association delivered; an abort or a
        dropped connection leaves them to the quiet-period rule."""
        staging = self._ready.pop(info.id, None)
        if staging is not None:
            staging.abandon()
        self._refill.set()
        self.tracker.closed(info.id, released=released)
        self.audit.association_closed(info.id)

    # -- C-STORE ---------------------------------------------------------------------------

    def store(self, info: AssociationInfo, request: StoreRequest) -> StoreOutcome:
        """Validate, write atomically, record, reply; never raise.

        A CT instance's outcome carries its follow-ups, run after the response is sent: first
        the association's next staging file is created (whatever the status: the sender is
        already sending the next instance), then, for a stored instance, metrics and the
        streaming decoder hear of it (:meth:`_stored`).
        """
        preopen: tuple[FollowUp, ...] = ()
        try:
            sop_class = request.sop_class_uid
            sop_uid = request.sop_instance_uid
            if not valid_uid(sop_uid):
                log.warning(
                    "refused instance with invalid SOP Instance UID from %s", info.calling_ae
                )
                return _outcome((BAD_UID, "invalid Affected SOP Instance UID"))
            meta = file_meta(sop_class, sop_uid, request.transfer_syntax, info.calling_ae)
            incoming = len(meta) + len(request.dataset)
            if sop_class in CT_CLASSES and self.disk.ok(incoming):
                # The next instance's file is created while its sender is still sending it.
                preopen = (partial(self._preopen, info),)
                result = self._store_ct(info, request, meta, incoming)
                if isinstance(result, Arrival):
                    # Metrics and the streaming decoder hear of it once the response is on
                    # its way: a decoding thread woken now would hold the GIL while this
                    # thread wants to send.
                    return StoreOutcome(
                        SUCCESS, after=(*preopen, partial(self._stored, result, info))
                    )
                return _outcome(result, preopen)
            # Nothing to write: another SOP class (accepted and ignored) or no room on disk.
            status = self._admit(info, request, incoming, room=False)
            assert not isinstance(status, _Admitted)  # (only with room)
            return _outcome(status)
        except Exception as exc:
            log_failure(log, "C-STORE handler failed", exc=exc)
            if is_ledger_outage(exc):
                return _outcome((OUT_OF_RESOURCES, "cannot record the instance"), preopen)
            return _outcome((OUT_OF_RESOURCES, "internal error; see the node log"), preopen)

    def _store_ct(
        self, info: AssociationInfo, req: StoreRequest, meta: bytes, incoming: int
    ) -> _Status | Arrival:
        """A CT instance: its file is written and synced in this thread while a helper parses
        and checks its header and commits its ledger row (:meth:`_admit`); then the file gets
        its name, and 0x0000 goes back only when all of it is durable.

        The write and its sync are one system call (``O_DSYNC``) during which this thread
        holds no GIL, so the helper's pure-Python work runs beside it. A crash after the row
        and before the rename leaves a row whose file is missing, never acknowledged:
        start-up removes it (:meth:`Ledger.drop_unstored_instances`).

        Returns the status to answer, or the stored instance's :class:`Arrival` (success).
        """
        try:
            staging = self._ready.pop(info.id, None) or self.spool.open_staged()
        except SpoolError as exc:
            log.error("spool write failed: %s", exc)
            return OUT_OF_RESOURCES, "cannot write to the spool"
        admitting = self._helper.submit(self._admit, info, req, incoming, room=True)
        staged: Staged | None = None
        try:
            staged = staging.write_synced([meta, req.dataset])
        except SpoolError as exc:
            log.error("spool write failed: %s", exc)
        admitted = False
        try:
            outcome = admitting.result()
            admitted = isinstance(outcome, _Admitted)
        finally:
            if not admitted and staged is not None:
                Spool.discard(staged)  # refused, or the helper failed: nothing to keep
        if not isinstance(outcome, _Admitted):
            return outcome
        rec = outcome.rec
        try:
            if staged is None:
                self._unstore(rec.sop_instance_uid, None)
                return OUT_OF_RESOURCES, "cannot write to the spool"
            try:
                self.spool.place(
                    staged, rec.study_instance_uid, rec.series_instance_uid, rec.sop_instance_uid
                )
                self.spool.sync_folder(outcome.path, staged)
            except SpoolError as exc:
                log.error("spool write failed: %s", exc)
                self._unstore(rec.sop_instance_uid, outcome.path)
                return OUT_OF_RESOURCES, "cannot write to the spool"
        finally:
            self._release(rec.sop_instance_uid)
        series_uid = rec.series_instance_uid
        if outcome.restored:
            self._restored.add(series_uid)
        self.budget.add(series_uid, staged.size)
        span = outcome.header.pixel_span
        arrival = Arrival(
            series_uid,
            rec.sop_instance_uid,
            outcome.path,
            rec.calling_ae,
            staged.size,
            header=outcome.header.dataset,
            pixels=None if span is None else req.dataset[span[0] : span[0] + span[1]],
            transfer_syntax=req.transfer_syntax,
        )
        return arrival

    def _resume(self, series_uid: str) -> None:
        """A stored-again instance may complete a series whose job failed for missing files:
        that job runs again (same result UIDs) once every file is whole. Never fails the
        store (the instance is durable and recorded)."""
        try:
            resumed = self.ledger.resume_restored(series_uid)
        except Exception as exc:
            log.warning("could not check for a job waiting for these files: %s", exc)
            return
        for job_id in resumed:
            log.info("job %d: its missing instance files were sent again; it runs again", job_id)

    def _unstore(self, sop_uid: str, path: Path | None) -> None:
        """Undo a refused instance: its file (renamed into the spool but not made durable)
        first, then its row. A file left behind would be taken in at the next start as an
        acknowledged instance whose row was lost; a row left behind (the ledger cannot write
        either, the disk being full) is not taken for a stored copy: a resend checks the
        file (:meth:`_recorded_file_whole`) and stores it."""
        if path is not None:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.error("could not remove the refused instance's file %s: %s", path.name, exc)
        try:
            self.ledger.forget_instance(sop_uid)
        except Exception as exc:
            log.error("could not remove the refused instance's ledger row: %s", exc)

    def _admit(
        self, info: AssociationInfo, req: StoreRequest, incoming: int, *, room: bool
    ) -> _Status | _Admitted:
        """Parse and check an instance and, for a CT instance to be kept, commit its ledger
        row under a claim on its SOP Instance UID (released by the caller once the file is
        durable or discarded). Returns the status to answer when nothing is to be kept."""
        sop_class, sop_uid, calling = req.sop_class_uid, req.sop_instance_uid, info.calling_ae
        ts = req.transfer_syntax
        try:
            header = parse_header(req.dataset, ts, max_inflated=self.options.max_dataset_bytes)
        except InflateLimitError as exc:
            log.warning(
                "instance from %s refused: %s (%d bytes as sent)", calling, exc, len(req.dataset)
            )
            return OUT_OF_RESOURCES, str(exc)
        except HeaderError as exc:
            log.warning("refused unparseable instance from %s: %s", calling, exc)
            return CANNOT_UNDERSTAND, f"cannot parse dataset: {exc}"
        ds = header.dataset
        mismatch = _mismatch(header, sop_class, sop_uid)
        if mismatch is not None:
            ds_class = str(ds.get("SOPClassUID", "")).rstrip("\x00 ")
            log.warning(
                "refused instance from %s: %s (request: %s; dataset: %s)",
                calling,
                mismatch,
                UID(sop_class).name if sop_class else "none",
                UID(ds_class).name if ds_class else "none",
            )
            return SOP_MISMATCH, mismatch
        study_uid = str(ds.get("StudyInstanceUID", ""))
        series_uid = str(ds.get("SeriesInstanceUID", ""))
        if not (valid_uid(study_uid) and valid_uid(series_uid)):
            log.warning("refused instance without valid Study/Series Instance UID from %s", calling)
            return MISSING_ATTRIBUTE, "missing or invalid Study/Series Instance UID"
        rec = InstanceRecord(
            sop_instance_uid=sop_uid,
            sop_class_uid=sop_class,
            series_instance_uid=series_uid,
            study_instance_uid=study_uid,
            transfer_syntax_uid=ts,
            modality=str(ds.get("Modality", "")),
            calling_ae=calling,
        )
        own = str(ds.get("Manufacturer", "")) == OWN_MANUFACTURER and sop_class not in CT_CLASSES
        # Results are SEG and SR, never CT: only other classes need the ledger lookup.
        if own or (sop_class not in CT_CLASSES and self.ledger.is_own_result(sop_uid, series_uid)):
            self.ledger.record_ignored(rec, "object produced by this node (loop guard)")
            log.info("ignored an object this node produced (loop guard)")
            return SUCCESS
        if sop_class not in CT_CLASSES:
            name = UID(sop_class).name if sop_class else "unknown"
            self.ledger.record_ignored(rec, f"SOP class {name} is not CT; accepted and ignored")
            log.info("accepted and ignored a %s instance from %s", name, calling)
            return SUCCESS
        if not self._try_claim(sop_uid):
            log.warning("instance from %s refused: another association stores it", calling)
            return OUT_OF_RESOURCES, "being stored by another association; retry"
        admitted: _Admitted | None = None
        try:
            outcome = self._record(info, rec, header, incoming, room)
            if isinstance(outcome, _Admitted):
                admitted = outcome
            return outcome
        finally:
            if admitted is None:
                self._release(sop_uid)

    def _record(
        self,
        info: AssociationInfo,
        rec: InstanceRecord,
        header: Header,
        incoming: int,
        room: bool,
    ) -> _Status | _Admitted:
        """Under the claim: refuse what must not be kept, else commit the instance's row."""
        sop_uid, series_uid = rec.sop_instance_uid, rec.series_instance_uid
        if not room or (over := self.budget.admits(series_uid, incoming)) is not None:
            if self.ledger.has_instance(sop_uid):
                return self._duplicate(info, series_uid, sop_uid, incoming)
            if not room:
                log.error("instance refused: free disk below node.min_free_disk_mb")
                return OUT_OF_RESOURCES, "free disk below the node's floor"
            log.warning("instance from %s refused: %s", info.calling_ae, over)
            return OUT_OF_RESOURCES, str(over)
        # From here this association delivers the series: a release elsewhere must not
        # complete it before this instance is in.
        self.tracker.touched(info.id, series_uid)
        path = self.spool.path_for(rec.study_instance_uid, series_uid, sop_uid)
        # Committed without a WAL fsync (see Ledger.record_instance): the file, synced before
        # the answer, is the durable record. The row's unique SOP Instance UID is the
        # duplicate check: under the claim, a row that exists is one whose file is durable.
        try:
            if not self.ledger.record_instance(rec, path, incoming):
                if self._recorded_file_whole(sop_uid):
                    return self._duplicate(info, series_uid, sop_uid, incoming)
                # Recorded without its file (another node died, or this node's commit was
                # not confirmed): this node stores it, and the row points at this copy,
                # made durable before the answer.
                # (When the row went meanwhile, its node's start-up dropped it: record anew.)
                moved = self.ledger.move_instance(sop_uid, path, incoming)
                if not moved and not self.ledger.record_instance(rec, path, incoming):
                    return OUT_OF_RESOURCES, "instance being stored elsewhere; retry"
                log.info(
                    "instance recorded without its file (a node died, a commit went "
                    "unconfirmed, or a power cut took the file): stored here"
                )
                return _Admitted(rec, header, path, restored=True)
        except Exception as exc:
            log.error("ledger write failed: %s", exc)
            return OUT_OF_RESOURCES, "cannot record the instance"
        return _Admitted(rec, header, path)

    def _recorded_file_whole(self, sop_uid: str) -> bool:
        """Whether a recorded instance's bytes are whole where its row says.

        Its file may be missing: another node on a shared ledger committed the row and died
        before writing the file (or is writing it now), or this node's row was committed
        while the connection to a PostgreSQL ledger broke, so the write was answered as
        failed. Under this process's claim no association of ours is writing it.

        It may also be missing where this node refused the instance and could not remove its
        row (the disk was full for the ledger too): the file is looked at, not the row alone.
        """
        found = self.ledger.instance_file(sop_uid)
        if found is None:
            return False
        try:
            if found[0].stat().st_size == found[1]:
                return True
        except OSError:
            pass
        # Retention deleted the files of a delivered series: a resend is a duplicate.
        return self.ledger.instance_purged(sop_uid)

    def _duplicate(
        self, info: AssociationInfo, series_uid: str, sop_uid: str, incoming: int
    ) -> _Status:
        """Acknowledge an instance already stored; one whose size differs from the stored
        copy's is a different instance under the same UID (a corrected resend): the stored copy
        is kept, and the difference is logged and recorded as an event, not passed over."""
        log.info("duplicate instance from %s acknowledged, not stored again", info.calling_ae)
        try:
            found = self.ledger.instance_file(sop_uid)
        except Exception as exc:  # the answer stays success: the instance is stored
            log.warning("could not compare a duplicate with its stored copy: %s", exc)
            found = None
        if found is not None and found[1] != incoming:
            message = (
                f"instance {sop_uid} of series {series_uid} sent again by {info.calling_ae} "
                f"with other content ({incoming} bytes; the stored copy has {found[1]}): the "
                "stored copy is kept; send a corrected instance with a new SOP Instance UID"
            )
            log.warning("%s", message)
            try:
                self.ledger.event("duplicate-differs", message)
            except Exception as exc:
                log.warning("could not record the event: %s", exc)
        self.tracker.touched(info.id, series_uid)
        return SUCCESS

    def _try_claim(self, sop_uid: str) -> bool:
        """Hold ``sop_uid`` for one association at a time (False: another one holds it).

        An instance's ledger row is committed while its file is being made durable; the
        claim makes sure nobody acknowledges it as a duplicate in that window.
        """
        with self._claims_lock:
            if sop_uid in self._claims:
                return False
            self._claims.add(sop_uid)
            return True

    def _release(self, sop_uid: str) -> None:
        with self._claims_lock:
            self._claims.discard(sop_uid)

    def _preopen(self, info: AssociationInfo) -> None:
        """After a response: create the association's next staged file (no error here: the
        next C-STORE creates its own and reports a failure)."""
        if info.id in self._ready:
            return
        with suppress(SpoolError):
            self._ready[info.id] = self.spool.open_staged()

    def _stored(self, arrival: Arrival, info: AssociationInfo) -> None:
        """After the response: tell metrics, the streaming decoder and the audit trail (which
        counts it for the association's DICOM Instances Transferred); a series with an
        instance stored again may have a job to resume (:meth:`_resume`)."""
        self.audit.received(
            info.id, info.calling_ae, info.address, arrival.series_uid, arrival.header
        )
        if self.on_instance is not None:
            self.on_instance(arrival)
        if arrival.series_uid in self._restored:
            self._restored.discard(arrival.series_uid)
            self._resume(arrival.series_uid)


def _mismatch(header: Header, sop_class: str, sop_uid: str) -> str | None:
    """Why a dataset does not match its C-STORE request or its SOP class (0xA900, PS3.4
    §B.2.3), or None.

    SOP Class UID and SOP Instance UID are Type 1 in every storage IOD (SOP Common module,
    PS3.3 §C.12.1) and must be the request's Affected SOP Class and Instance UIDs (PS3.4
    §B.4.1.1); the file meta written for the instance is built from the request, so a dataset
    that contradicts it would be stored under another identity. Pixel Data is Type 1 in the
    CT IODs the node processes (PS3.3 §A.3, §A.38); other classes are only recorded as
    ignored, so their contents are not judged.
    """
    ds = header.dataset
    ds_sop = str(ds.get("SOPInstanceUID", "")).rstrip("\x00 ")
    if not ds_sop:
        return "dataset has no SOP Instance UID (0008,0018)"
    if ds_sop != sop_uid:
        return "SOP Instance UID differs from the C-STORE request"
    ds_class = str(ds.get("SOPClassUID", "")).rstrip("\x00 ")
    if not ds_class:
        return "dataset has no SOP Class UID (0008,0016)"
    if ds_class != sop_class:
        return "SOP Class UID differs from the C-STORE request"
    if sop_class in CT_CLASSES and not header.has_pixel_data:
        return f"{UID(sop_class).name} dataset has no Pixel Data (7FE0,0010)"
    return None


def record_from_file(path: Path) -> InstanceRecord:
    """The ledger record of a spooled instance, read back from its file (start-up recovery of
    rows a power cut lost; see :meth:`segnode.storage.ledger.Ledger.missing_instances`).

    Raises
    ------
    ValueError
        If the file is not a readable instance with valid UIDs.
    """
    try:
        ds = dcmread(path, stop_before_pixels=True, specific_tags=_RECORD_TAGS)
    except (OSError, InvalidDicomError, ValueError) as exc:
        raise ValueError(f"{path.name}: cannot read: {exc}") from exc
    meta = ds.file_meta
    rec = InstanceRecord(
        sop_instance_uid=str(meta.get("MediaStorageSOPInstanceUID", "")),
        sop_class_uid=str(meta.get("MediaStorageSOPClassUID", "")),
        series_instance_uid=str(ds.get("SeriesInstanceUID", "")),
        study_instance_uid=str(ds.get("StudyInstanceUID", "")),
        transfer_syntax_uid=str(meta.get("TransferSyntaxUID", "")),
        modality=str(ds.get("Modality", "")),
        calling_ae=str(meta.get("SourceApplicationEntityTitle", "")).strip(),
    )
    uids = (rec.sop_instance_uid, rec.study_instance_uid, rec.series_instance_uid)
    if not all(valid_uid(u) for u in uids):
        raise ValueError(f"{path.name}: missing or invalid UIDs")
    return rec


_RECORD_TAGS = ["StudyInstanceUID", "SeriesInstanceUID", "Modality"]


def _meta_element(element: int, vr: bytes, value: bytes) -> bytes:
    if len(value) % 2:
        value += b"\x00" if vr in (b"UI", b"OB") else b" "
    if vr == b"OB":
        return struct.pack("<HH2s2xI", 0x0002, element, vr, len(value)) + value
    return struct.pack("<HH2sH", 0x0002, element, vr, len(value)) + value


def file_meta(sop_class: str, sop_uid: str, transfer_syntax: str, calling_ae: str) -> bytes:
    """Preamble, prefix and File Meta Information (PS3.10 §7.1) for a received instance.

    Encoded by hand (explicit VR little endian, group 0002): the same bytes as pydicom's
    ``encode_file_meta`` (tested), at a thirtieth of the cost on the C-STORE path.
    """
    body = b"".join(
        [
            _meta_element(0x0001, b"OB", b"\x00\x01"),
            _meta_element(0x0002, b"UI", sop_class.encode("ascii")),
            _meta_element(0x0003, b"UI", sop_uid.encode("ascii")),
            _meta_element(0x0010, b"UI", transfer_syntax.encode("ascii")),
            _meta_element(0x0012, b"UI", IMPLEMENTATION_CLASS_UID.encode("ascii")),
            _meta_element(0x0013, b"SH", IMPLEMENTATION_VERSION.encode("ascii")),
            _meta_element(0x0016, b"AE", calling_ae.encode("ascii", "replace"))
            if calling_ae
            else b"",
        ]
    )
    length = struct.pack("<HH2sHI", 0x0002, 0x0000, b"UL", 4, len(body))
    return b"\x00" * 128 + b"DICM" + length + body
