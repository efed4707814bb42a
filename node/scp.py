"""The Storage SCP: accept, write, record, reply.

The transport is :mod:`node.ul`, a blocking, non-polling Upper Layer acceptor (one thread per
association). The C-STORE handler follows pynetdicom's ``apps/common.py:handle_store`` shape:
it never decodes pixels and never waits for inference. It validates the request, parses the
elements before Pixel Data, writes the bytes as received to the spool atomically, records the
instance in the ledger, and only then answers 0x0000. Failures map to statuses (PS3.4
§B.2.3) with an Error Comment (0000,0902) saying why: 0xA700 out of resources (disk or
ledger), 0xA900 SOP instance mismatch, 0xC210-0xC212 cannot understand.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydicom import dcmread
from pydicom.errors import InvalidDicomError
from pydicom.uid import UID
from pynetdicom import ALL_TRANSFER_SYNTAXES
from pynetdicom.presentation import AllStoragePresentationContexts
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    CTImageStorage,
    EnhancedCTImageStorage,
    Verification,
)

from node import tls
from node.config import Config
from node.guards import AccessPolicy, DiskGuard, SeriesBudget
from node.header import Header, HeaderError, parse_header
from node.series import CompletionTracker
from node.streaming import Arrival
from node.ul import (
    IMPLEMENTATION_CLASS_UID,
    IMPLEMENTATION_VERSION,
    Acceptor,
    AcceptorOptions,
    AssociationInfo,
    StoreRequest,
    StoreResult,
)
from storage.ledger import InstanceRecord, Ledger
from storage.spool import Spool, SpoolError, Staged, valid_uid

log = logging.getLogger(__name__)

CT_CLASSES = frozenset({str(CTImageStorage), str(EnhancedCTImageStorage)})
OWN_MANUFACTURER = "segnode"

# Status codes (PS3.4 Annex B.2.3; PS3.7 Annex C)
SUCCESS = 0x0000
OUT_OF_RESOURCES = 0xA700
CANNOT_UNDERSTAND = 0xC210
BAD_UID = 0xC211
MISSING_ATTRIBUTE = 0xC212
SOP_MISMATCH = 0xA900


class StoreSCP:
    """The node's listening application entity and its service handlers.

    Parameters
    ----------
    config
        The node configuration.
    ledger, spool
        Durable state.
    tracker
        Series-completion tracker notified of every instance and association end.
    on_stored
        Called after each stored instance (for metrics and streaming hooks); may be None.
    """

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        spool: Spool,
        tracker: CompletionTracker,
        on_stored: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.spool = spool
        self.tracker = tracker
        self.on_stored = on_stored
        #: Called with every stored (durable, recorded) CT instance: streaming assembly.
        self.on_instance: Callable[[Arrival], None] | None = None
        nc = config.node
        self.options = AcceptorOptions(
            ae_title=nc.ae_title,
            contexts=self._contexts(),
            max_pdu=nc.max_pdu,
            # A connection that never sends its A-ASSOCIATE-RQ (a port scan, garbage) holds an
            # association slot until the ACSE timeout: keep that short.
            acse_timeout=min(nc.network_timeout_s, 10.0),
            network_timeout=nc.network_timeout_s,
            max_associations=nc.max_associations,
            # An instance larger than a whole series may be is refused while it streams in.
            max_dataset_bytes=nc.max_series_mb * 2**20,
        )
        self.server: Acceptor | None = None
        self.tls_server: Acceptor | None = None
        self.access = AccessPolicy(nc)
        self.disk = DiskGuard(spool.root, nc.min_free_disk_mb)
        self.budget = SeriesBudget(
            nc.max_series_instances, nc.max_series_mb * 2**20, ledger.series_totals
        )
        # Header parses beside the staged write: one in flight per association at most.
        self._parser = ThreadPoolExecutor(nc.max_associations, thread_name_prefix="header-parse")
        self._claims: set[str] = set()
        self._claims_lock = threading.Lock()

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
        if ctx is not None and not tls_only:
            self.tls_server = self._listen(tc.port, ctx)
        if ctx is not None:
            log.info(
                "DICOM TLS (min %s, client certificate %s) on %s:%d",
                tc.min_version,
                "required" if tc.require_client_cert else "optional",
                nc.host,
                self.tls_port or self.port,
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
        """The bound port (useful when config asked for port 0)."""
        assert self.server is not None
        return self.server.server_address[1]

    @property
    def tls_port(self) -> int | None:
        """The bound port of a separate TLS listener (``tls.port``), if any."""
        return None if self.tls_server is None else self.tls_server.server_address[1]

    def stop(self) -> None:
        """Stop accepting; associations in flight finish first."""
        for server in (self.tls_server, self.server):
            if server is not None:
                server.stop()
        self.tls_server = self.server = None
        self._parser.shutdown(wait=True)

    # -- association lifecycle (node.ul.Handlers) ------------------------------------------

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
        return None

    def accepted(self, info: AssociationInfo) -> None:
        """Track the new association."""
        self.tracker.opened(id(info), info.calling_ae)
        log.info("association accepted from %s (%s:%s)", info.calling_ae, info.address, info.port)

    def closed(self, info: AssociationInfo, released: bool) -> None:
        """A normal release completes the series this association delivered; an abort or a
        dropped connection leaves them to the quiet-period rule."""
        done = self.tracker.closed(id(info), released=released)
        if released:
            log.info("association released; %d series complete", len(done))

    # -- C-STORE ---------------------------------------------------------------------------

    def store(self, info: AssociationInfo, request: StoreRequest) -> StoreResult:
        """Validate, write atomically, record, reply; never raise."""
        try:
            return self._store(info, request)
        except Exception:
            log.exception("unexpected error in C-STORE handler")
            return OUT_OF_RESOURCES, "internal error; see the node log"

    def _store(self, info: AssociationInfo, req: StoreRequest) -> StoreResult:
        sop_class = req.sop_class_uid
        sop_uid = req.sop_instance_uid
        if not valid_uid(sop_uid):
            log.warning("refused instance with invalid SOP Instance UID from %s", info.calling_ae)
            return BAD_UID, "invalid Affected SOP Instance UID"
        meta = file_meta(sop_class, sop_uid, req.transfer_syntax, info.calling_ae)
        incoming = len(meta) + len(req.dataset)
        staging: Future[Staged] | None = None
        parsing: Future[Header] | None = None
        if sop_class in CT_CLASSES and self.disk.ok(incoming):
            # The file is written and synced while the header is parsed; only a valid
            # instance gets its name (Spool.place), and only then a ledger row and 0x0000.
            staging, parsing = self._stage_while_parsing(req, meta)
        try:
            status, staging = self._check_and_keep(info, req, incoming, staging, parsing)
            return status
        finally:
            if staging is not None:
                staging.add_done_callback(_discard_staged)

    def _stage_while_parsing(
        self, req: StoreRequest, meta: bytes
    ) -> tuple[Future[Staged], Future[Header] | None]:
        """Write and sync the staged file in this thread while a helper parses the header.

        The write and its sync are one system call (``O_DSYNC``) during which this thread
        does not hold the GIL, so the parse (pure Python) runs beside it. The file is opened
        before the helper is started: a second system call after that would wait for the
        parse to let go of the GIL. Returns the staged file (a completed future; its
        exception: :class:`SpoolError`) and the header parse (its exception:
        :class:`HeaderError`); no parse (None) when the file could not even be created.
        """
        staging: Future[Staged] = Future()
        try:
            staged_file = self.spool.open_staged()
        except SpoolError as exc:
            staging.set_exception(exc)
            return staging, None
        parsing = self._parser.submit(parse_header, req.dataset, req.transfer_syntax)
        try:
            staging.set_result(staged_file.write_synced([meta, req.dataset]))
        except SpoolError as exc:
            staging.set_exception(exc)
        return staging, parsing

    def _check_and_keep(
        self,
        info: AssociationInfo,
        req: StoreRequest,
        incoming: int,
        staging: Future[Staged] | None,
        parsing: Future[Header] | None = None,
    ) -> tuple[StoreResult, Future[Staged] | None]:
        """Everything after the UID check; returns the status and the staged write if it was
        not used (to be discarded)."""
        sop_class, sop_uid, calling = req.sop_class_uid, req.sop_instance_uid, info.calling_ae
        ts = req.transfer_syntax
        try:
            header = parse_header(req.dataset, ts) if parsing is None else parsing.result()
        except HeaderError as exc:
            log.warning("refused unparseable instance from %s: %s", calling, exc)
            return (CANNOT_UNDERSTAND, f"cannot parse dataset: {exc}"), staging
        ds = header.dataset
        ds_sop = str(ds.get("SOPInstanceUID", ""))
        if ds_sop and ds_sop != sop_uid:
            log.warning("refused instance whose SOP Instance UID differs from the request")
            return (SOP_MISMATCH, "SOP Instance UID differs from the C-STORE request"), staging
        study_uid = str(ds.get("StudyInstanceUID", ""))
        series_uid = str(ds.get("SeriesInstanceUID", ""))
        if not (valid_uid(study_uid) and valid_uid(series_uid)):
            log.warning("refused instance without valid Study/Series Instance UID from %s", calling)
            return (MISSING_ATTRIBUTE, "missing or invalid Study/Series Instance UID"), staging
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
            return SUCCESS, staging
        if sop_class not in CT_CLASSES:
            name = UID(sop_class).name if sop_class else "unknown"
            self.ledger.record_ignored(rec, f"SOP class {name} is not CT; accepted and ignored")
            log.info("accepted and ignored a %s instance from %s", name, calling)
            return SUCCESS, staging
        with self._claim(sop_uid) as claimed:
            if not claimed:
                log.warning("instance from %s refused: another association stores it", calling)
                return (OUT_OF_RESOURCES, "being stored by another association; retry"), staging
            return self._keep(info, req, rec, header, incoming, staging)

    def _duplicate(self, info: AssociationInfo, series_uid: str) -> StoreResult:
        log.info("duplicate instance from %s acknowledged, not stored again", info.calling_ae)
        self.tracker.touched(id(info), series_uid)
        return SUCCESS

    @contextmanager
    def _claim(self, sop_uid: str) -> Iterator[bool]:
        """Hold ``sop_uid`` for one association at a time (False: another one holds it).

        An instance's ledger row is committed while its file is being made durable; the
        claim makes sure nobody acknowledges it as a duplicate in that window.
        """
        with self._claims_lock:
            if sop_uid in self._claims:
                yield False
                return
            self._claims.add(sop_uid)
        try:
            yield True
        finally:
            with self._claims_lock:
                self._claims.discard(sop_uid)

    def _keep(
        self,
        info: AssociationInfo,
        req: StoreRequest,
        rec: InstanceRecord,
        header: Header,
        incoming: int,
        staging: Future[Staged] | None,
    ) -> tuple[StoreResult, Future[Staged] | None]:
        """Store a valid CT instance (under its claim): row and file, then the status."""
        sop_uid, calling = rec.sop_instance_uid, info.calling_ae
        study_uid, series_uid = rec.study_instance_uid, rec.series_instance_uid
        if staging is None or (over := self.budget.admits(series_uid, incoming)) is not None:
            if self.ledger.has_instance(sop_uid):
                return self._duplicate(info, series_uid), staging
            if staging is None:
                log.error("instance refused: free disk below node.min_free_disk_mb")
                return (OUT_OF_RESOURCES, "free disk below the node's floor"), None
            log.warning("instance from %s refused: %s", calling, over)
            return (OUT_OF_RESOURCES, str(over)), staging
        # From here this association delivers the series: a release elsewhere must not
        # complete it before this instance is in.
        self.tracker.touched(id(info), series_uid)
        path = self.spool.path_for(study_uid, series_uid, sop_uid)
        # The staged file is synced already; the ledger row is committed (no WAL fsync: the
        # file is the durable record, see Ledger.record_instance), then the file gets its
        # name and its folder is fsynced. 0x0000 goes back only when all of it is durable.
        # A crash in between leaves at most a row whose file is missing, never
        # acknowledged: start-up removes it (Ledger.drop_unstored_instances). The row's
        # unique SOP Instance UID is the duplicate check: under the claim, a row that exists
        # is one whose file is durable.
        try:
            if not self.ledger.record_instance(rec, path, incoming):
                return self._duplicate(info, series_uid), staging
        except Exception as exc:
            log.error("ledger write failed: %s", exc)
            return (OUT_OF_RESOURCES, "cannot record the instance"), staging
        try:
            staged = staging.result()
            self.spool.place(staged, study_uid, series_uid, sop_uid)
            self.spool.sync_folder(path)
        except SpoolError as exc:
            log.error("spool write failed: %s", exc)
            self.ledger.forget_instance(sop_uid)
            return (OUT_OF_RESOURCES, "cannot write to the spool"), None
        size = staged.size
        self.budget.add(series_uid, size)
        span = header.pixel_span
        arrival = Arrival(
            series_uid,
            sop_uid,
            path,
            calling,
            size,
            header=header.dataset,
            pixels=None if span is None else req.dataset[span[0] : span[0] + span[1]],
            transfer_syntax=req.transfer_syntax,
        )
        # Metrics and the streaming decoder hear of it once the response is on its way: a
        # decoding thread woken now would hold the GIL while this thread wants to send.
        info.after_reply.append(lambda: self._stored(arrival))
        return SUCCESS, None

    def _stored(self, arrival: Arrival) -> None:
        """After the response: tell metrics and the streaming decoder."""
        if self.on_stored is not None:
            self.on_stored(arrival.series_uid)
        if self.on_instance is not None:
            self.on_instance(arrival)


def record_from_file(path: Path) -> InstanceRecord:
    """The ledger record of a spooled instance, read back from its file (start-up recovery of
    rows a power cut lost; see :meth:`storage.ledger.Ledger.missing_instances`).

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


def _discard_staged(staging: Future[Staged]) -> None:
    """Delete a staged file that was not kept (runs when its write has finished)."""
    if not staging.cancelled() and staging.exception() is None:
        Spool.discard(staging.result())


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
