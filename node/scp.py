"""The Storage SCP: accept, write, record, reply.

The C-STORE handler follows pynetdicom's ``apps/common.py:handle_store`` shape: it never
decodes pixels and never waits for inference. It validates the request, parses the elements
before Pixel Data, writes the bytes as received to the spool atomically, records the instance
in the ledger, and only then answers 0x0000. Failures map to statuses (PS3.4 §B.2.3):
0xA700 out of resources (disk or ledger), 0xC210-0xC213 cannot understand.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from pydicom.uid import UID
from pynetdicom import AE, ALL_TRANSFER_SYNTAXES, evt
from pynetdicom.dimse_primitives import C_STORE
from pynetdicom.dsutils import encode_file_meta
from pynetdicom.presentation import AllStoragePresentationContexts
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    CTImageStorage,
    EnhancedCTImageStorage,
    Verification,
)

from node import tls
from node.config import Config
from node.guards import AccessPolicy, DiskGuard, SeriesBudget
from node.header import HeaderError, parse_header
from node.series import CompletionTracker
from node.streaming import Arrival
from storage.ledger import InstanceRecord, Ledger
from storage.spool import Spool, SpoolError, valid_uid

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
    """The node's listening application entity and its event handlers.

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
        self.server: Any = None
        self.ae = self._make_ae()
        nc = config.node
        self.access = AccessPolicy(nc)
        self.disk = DiskGuard(spool.root, nc.min_free_disk_mb)
        self.budget = SeriesBudget(
            nc.max_series_instances, nc.max_series_mb * 2**20, ledger.series_totals
        )
        self.tls_server: Any = None

    def _make_ae(self) -> AE:
        nc = self.config.node
        ae = AE(ae_title=nc.ae_title)
        ae.maximum_pdu_size = nc.max_pdu
        ae.network_timeout = nc.network_timeout_s
        # A connection that never sends its A-ASSOCIATE-RQ (a port scan, garbage) holds an
        # association slot until the ACSE timeout: keep that short.
        ae.acse_timeout = min(nc.network_timeout_s, 10.0)
        ae.dimse_timeout = nc.network_timeout_s
        ae.maximum_associations = nc.max_associations
        # Calling AE titles (and their hosts) are checked by handle_requested.
        ae.add_supported_context(Verification)
        ae.add_supported_context(CTImageStorage, ALL_TRANSFER_SYNTAXES)
        ae.add_supported_context(EnhancedCTImageStorage, ALL_TRANSFER_SYNTAXES)
        if nc.other_sop_classes == "ignore":
            for cx in AllStoragePresentationContexts:
                syntax = str(cx.abstract_syntax)
                if syntax not in CT_CLASSES:
                    ae.add_supported_context(syntax, ALL_TRANSFER_SYNTAXES)
        return ae

    def start(self) -> None:
        """Start listening (non-blocking)."""
        handlers: list[Any] = [
            (evt.EVT_C_STORE, self.handle_store),
            (evt.EVT_C_ECHO, self.handle_echo),
            (evt.EVT_ACCEPTED, self.handle_accepted),
            (evt.EVT_RELEASED, self.handle_released),
            (evt.EVT_ABORTED, self.handle_aborted),
            (evt.EVT_CONN_CLOSE, self.handle_conn_close),
            (evt.EVT_REQUESTED, self.handle_requested),
        ]
        nc, tc = self.config.node, self.config.tls
        ctx = tls.server_context(tc) if tc.enabled else None
        tls_only = ctx is not None and tc.port in (0, nc.port)
        self.server = tls.start_server(
            self.ae,
            (nc.host, nc.port),
            handlers,
            context=ctx if tls_only else None,
            handshake_timeout=tc.handshake_timeout_s,
        )
        if ctx is not None and not tls_only:
            self.tls_server = tls.start_server(
                self.ae,
                (nc.host, tc.port),
                handlers,
                context=ctx,
                handshake_timeout=tc.handshake_timeout_s,
            )
        if ctx is not None:
            log.info(
                "DICOM TLS (min %s, client certificate %s) on %s:%d",
                tc.min_version,
                "required" if tc.require_client_cert else "optional",
                nc.host,
                self.tls_port or self.port,
            )

    @property
    def port(self) -> int:
        """The bound port (useful when config asked for port 0)."""
        return int(self.server.server_address[1])

    @property
    def tls_port(self) -> int | None:
        """The bound port of a separate TLS listener (``tls.port``), if any."""
        return None if self.tls_server is None else int(self.tls_server.server_address[1])

    def stop(self) -> None:
        """Stop accepting; associations in flight finish first (pynetdicom joins them)."""
        if self.tls_server is not None:
            self.tls_server.shutdown()
            self.tls_server = None
        if self.server is not None:
            self.server.shutdown()
            self.server = None

    # -- association lifecycle -------------------------------------------------------------

    def handle_requested(self, event: evt.Event) -> None:
        """A-ASSOCIATE-RQ received: check the calling AE (and host) and the disk floor.

        Rejections follow PS3.8 §9.3.4: an unknown calling AE title is a permanent rejection
        (source 1, reason 3); a full disk is transient congestion (source 3, reason 1).
        """
        assoc = event.assoc
        calling = str(getattr(assoc.requestor.primitive, "calling_ae_title", "") or "").strip()
        address = str(assoc.requestor.address)
        if not self.access.allows(calling, address):
            log.warning("association from %r at %s refused: not an allowed peer", calling, address)
            self._reject(assoc, (0x01, 0x01, 0x03))
        elif not self.disk.ok():
            log.error(
                "association from %r refused: free disk below node.min_free_disk_mb (%d MB)",
                calling,
                self.config.node.min_free_disk_mb,
            )
            self._reject(assoc, (0x02, 0x03, 0x01))

    @staticmethod
    def _reject(assoc: Any, rsd: tuple[int, int, int]) -> None:
        assoc.acse.send_reject(*rsd)
        assoc.is_rejected = True
        evt.trigger(assoc, evt.EVT_REJECTED, {})
        assoc.kill()

    def handle_accepted(self, event: evt.Event) -> None:
        """Track the new association."""
        self.tracker.opened(id(event.assoc), str(event.assoc.requestor.ae_title).strip())
        log.info(
            "association accepted from %s (%s:%s)",
            event.assoc.requestor.ae_title,
            event.assoc.requestor.address,
            event.assoc.requestor.port,
        )

    def handle_released(self, event: evt.Event) -> None:
        """A normal release completes the series this association delivered."""
        done = self.tracker.closed(id(event.assoc), released=True)
        log.info("association released; %d series complete", len(done))

    def handle_aborted(self, event: evt.Event) -> None:
        """An abort leaves its series to the quiet-period rule."""
        self.tracker.closed(id(event.assoc), released=False)
        log.warning("association aborted by peer")

    def handle_conn_close(self, event: evt.Event) -> None:
        """A dropped connection without release or abort counts as an abort."""
        self.tracker.closed(id(event.assoc), released=False)

    def handle_echo(self, event: evt.Event) -> int:
        """C-ECHO: always success."""
        return SUCCESS

    # -- C-STORE ---------------------------------------------------------------------------

    def handle_store(self, event: evt.Event) -> int:
        """Validate, write atomically, record, reply; never raise."""
        try:
            return self._store(event)
        except Exception:
            log.exception("unexpected error in C-STORE handler")
            return OUT_OF_RESOURCES

    def _store(self, event: evt.Event) -> int:
        req = cast(C_STORE, event.request)
        sop_class = str(req.AffectedSOPClassUID or "")
        sop_uid = str(req.AffectedSOPInstanceUID or "")
        calling = str(event.assoc.requestor.ae_title).strip()
        if not valid_uid(sop_uid):
            log.warning("refused instance with invalid SOP Instance UID from %s", calling)
            return BAD_UID
        ts = str(event.context.transfer_syntax)
        stream = event.encoded_dataset(include_meta=False)
        try:
            header = parse_header(stream, ts)
        except HeaderError as exc:
            log.warning("refused unparseable instance from %s: %s", calling, exc)
            return CANNOT_UNDERSTAND
        ds = header.dataset
        ds_sop = str(ds.get("SOPInstanceUID", ""))
        if ds_sop and ds_sop != sop_uid:
            log.warning("refused instance whose SOP Instance UID differs from the request")
            return SOP_MISMATCH
        study_uid = str(ds.get("StudyInstanceUID", ""))
        series_uid = str(ds.get("SeriesInstanceUID", ""))
        if not (valid_uid(study_uid) and valid_uid(series_uid)):
            log.warning("refused instance without valid Study/Series Instance UID from %s", calling)
            return MISSING_ATTRIBUTE
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
        if self.ledger.has_instance(sop_uid):
            log.info("duplicate instance from %s acknowledged, not stored again", calling)
            self.tracker.touched(id(event.assoc), series_uid)
            return SUCCESS
        meta = b"\x00" * 128 + b"DICM" + encode_file_meta(event.file_meta)
        incoming = len(meta) + len(stream)
        if not self.disk.ok(incoming):
            log.error("instance refused: free disk below node.min_free_disk_mb")
            return OUT_OF_RESOURCES
        over = self.budget.admits(series_uid, incoming)
        if over is not None:
            log.warning("instance from %s refused: %s", calling, over)
            return OUT_OF_RESOURCES
        try:
            path, size = self.spool.store(study_uid, series_uid, sop_uid, [meta, stream])
        except SpoolError as exc:
            log.error("spool write failed: %s", exc)
            return OUT_OF_RESOURCES
        try:
            self.ledger.record_instance(rec, path, size)
        except Exception as exc:
            log.error("ledger write failed: %s", exc)
            return OUT_OF_RESOURCES
        self.budget.add(series_uid, size)
        self.tracker.touched(id(event.assoc), series_uid)
        if self.on_stored is not None:
            self.on_stored(series_uid)
        if self.on_instance is not None:
            self.on_instance(Arrival(series_uid, sop_uid, path, calling, size))
        return SUCCESS
