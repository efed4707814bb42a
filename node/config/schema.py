"""The configuration's schema: one frozen dataclass per ``config.toml`` table.

This module owns what a configuration holds (field names, types and defaults, and the small
derived views such as :meth:`SeriesConfig.policy_for`); :mod:`segnode.node.config.parse` owns
reading ``config.toml`` into these types. A scalar setting that is read as it is (a number in
a range, a flag, a string among choices) is declared with :func:`setting`: its default and
what the parser accepts stand on one line, and the parser reads every such field the same
way. The other fields (addresses, files, lists of tables) have readers of their own.

``config.toml`` at the repository root documents every key with its default. The
``[routing]``, ``[[rules]]`` and ``[models.NAME]`` tables are
:class:`~segnode.node.routing.rules.Routing`, the destinations
:data:`~segnode.node.routing.destinations.Destination` (their modules own them and their
parsing).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from segnode.node.modelspec import DEFAULT_MODEL_NAME, ModelSpec
from segnode.node.peers import ClientTLS, Peer, parse_peer
from segnode.node.peers import ae_title as _ae
from segnode.node.peers import port as _port
from segnode.node.routing.destinations import Destination
from segnode.node.routing.rules import Routing

_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = _ROOT / "engines" / "models" / "tissue" / "tissue.json"
"""The bundled model's manifest: ``[model] manifest`` when the configuration names none."""
#: The documented default configuration at the repository root.
ROOT_CONFIG = _ROOT / "config.toml"

_T = TypeVar("_T", bool, int, float, str)

#: The key of a :func:`setting`'s :class:`Accepts` in its field's metadata.
SETTING = "segnode.setting"


@dataclass(frozen=True)
class Accepts:
    """What the parser accepts for a :func:`setting`: a number from ``low`` to ``high`` (None:
    no bound), or a string among ``choices`` (empty: any string)."""

    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()


def setting(
    default: _T,
    low: float | None = None,
    high: float | None = None,
    *,
    choices: tuple[str, ...] = (),
) -> _T:
    """A scalar setting: its default and what :mod:`~segnode.node.config.parse` accepts.

    The field's type says how it is read: ``bool`` (true or false), ``int`` (an integer from
    ``low`` to ``high``), ``float`` (a number from ``low`` to ``high``) or ``str`` (one of
    ``choices`` when given).
    """
    return field(default=default, metadata={SETTING: Accepts(low, high, choices)})


@dataclass(frozen=True)
class NodeConfig:
    """``[node]``: the listening application entity."""

    ae_title: str = "SEGNODE"
    host: str = setting("127.0.0.1")
    port: int = 11112
    max_pdu: int = 1 << 20
    allowed_calling_aes: tuple[str, ...] = ()
    other_sop_classes: str = setting("ignore", choices=("ignore", "reject"))
    max_associations: int = setting(16, 1, 1000)
    max_pending: int = setting(64, 1, 10_000)
    max_pending_per_host: int = setting(16, 1, 10_000)
    max_associations_per_host: int = setting(0, 0, 1000)
    association_request_timeout_s: float = setting(10.0, 0.1, 600)
    network_timeout_s: float = setting(60.0, 1)
    min_transfer_rate_kib_s: float = setting(16.0, 0)
    max_instance_mb: int = setting(1024, 1, 65536)
    check_called_ae: bool = setting(False)
    stop_grace_s: float = setting(5.0, 0, 600)
    min_free_disk_mb: int = setting(1024, 0)
    staging_pool_mb: int = setting(192, 0, 65536)
    max_series_instances: int = setting(10_000, 0)
    max_series_mb: int = setting(20480, 0)
    peers: tuple[PeerRule, ...] = ()


@dataclass(frozen=True)
class PeerRule:
    """``[[node.peers]]``: a calling AE title allowed to associate, optionally only from a host.

    ``host`` is an IP address, a network in CIDR notation or a host name (resolved at start);
    None accepts the AE title from any address. With ``port`` (and a ``host`` that is an
    address or a name, not a network) the peer is also a return address: the destination
    ``"@sender"`` sends results of its series to ``return_ae_title`` (default ``ae_title``)
    at ``host:port``, over TLS when ``tls`` is set.
    """

    ae_title: str
    host: str | None = None
    port: int | None = None
    return_ae_title: str | None = None
    tls: ClientTLS | None = None

    @property
    def return_peer(self) -> Peer | None:
        """Where ``"@sender"`` sends this peer's results (None without a port)."""
        if self.port is None or self.host is None:
            return None
        return Peer(self.return_ae_title or self.ae_title, self.host, self.port, self.tls)


@dataclass(frozen=True)
class TLSConfig:
    """``[tls]``: DICOM TLS on the listening side (PS3.15 Annex B.1 / B.9)."""

    enabled: bool = setting(False)
    port: int = setting(0, 0, 65535)
    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    require_client_cert: bool = setting(False)
    min_version: str = setting("1.2", choices=("1.2", "1.3"))
    handshake_timeout_s: float = setting(10.0, 0.1)


#: What ``[audit] on_full`` may say: drop the oldest queued message, or refuse new
#: associations until the audit record repository has taken some.
AUDIT_ON_FULL = ("drop_oldest", "refuse")


@dataclass(frozen=True)
class AuditConfig:
    """``[audit]``: IHE ATNA audit messages (DICOM PS3.15 Annex A.5) by syslog (RFC 5424)
    over TLS (RFC 5425) or UDP (RFC 5426), or to a file; off by default
    (:mod:`segnode.node.audit`, ``docs/operations.md``).

    ``cert_file`` and ``key_file`` default to ``[tls]``'s (the node's certificate);
    ``ca_file`` (the repository's CA) is required for a ``syslog+tls://`` destination.
    ``source_id`` is the AuditSourceID (default: the node's name).
    """

    enabled: bool = setting(False)
    destinations: tuple[str, ...] = ()
    max_queued: int = setting(100000, 100, 100_000_000)
    on_full: str = setting("drop_oldest", choices=AUDIT_ON_FULL)
    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    source_id: str = setting("")
    enterprise_site: str = setting("")


@dataclass(frozen=True)
class RetentionConfig:
    """``[retention]``: deleting spooled instances and results after delivery."""

    spool_days: float = setting(0.0, 0)
    check_interval_s: float = setting(600.0, 1)


#: Completion policies: which signals complete a sender's series (the quiet period is always
#: the fallback). "auto": association release or geometric completeness, whichever is first.
COMPLETION_MODES = ("auto", "release", "geometry", "quiet")


@dataclass(frozen=True)
class SenderPolicy:
    """``[[series.senders]]``: completion policy and job priority for one calling AE title."""

    ae_title: str
    completion: str = setting("auto", choices=COMPLETION_MODES)
    priority: int = setting(0, -1000, 1000)


@dataclass(frozen=True)
class SeriesConfig:
    """``[series]``: when a series is complete."""

    complete_on_release: bool = setting(True)
    quiet_period_s: float = setting(30.0, 0.1, 86400)
    min_slices: int = setting(2, 2)
    completion: str = setting("auto", choices=COMPLETION_MODES)
    senders: tuple[SenderPolicy, ...] = ()

    def policy_for(self, calling_ae: str) -> SenderPolicy:
        """The policy of ``calling_ae`` (the defaults when it has no ``[[series.senders]]``)."""
        for p in self.senders:
            if p.ae_title == calling_ae.strip():
                return p
        return SenderPolicy(ae_title=calling_ae.strip(), completion=self.completion)


@dataclass(frozen=True)
class StreamingConfig:
    """``[streaming]``: decoding instances into volumes while they arrive."""

    enabled: bool = setting(True)
    workers: int = setting(1, 1, 64)
    max_memory_mb: int = setting(2048, 0)
    warm_mb: int = setting(256, 0)


@dataclass(frozen=True)
class EngineConfig:
    """``[engine]``: what a job may use (``docs/operations.md``)."""

    #: Memory a job may bring the node to, in MiB (its estimated peak resident set,
    #: :func:`segnode.engines.memory.estimate_job`); a job estimated above it fails with
    #: that reason before it runs. 0: ``memory_fraction`` of the memory available at start.
    memory_limit: int = setting(0, 0)
    #: The share of the memory available at start (MemAvailable) that ``memory_limit = 0``
    #: gives.
    memory_fraction: float = setting(0.7, 0.05, 1.0)
    #: GPU memory the torch engine may take, in MiB (0: the whole GPU). A job that runs out
    #: of it tries again with fewer tiles per call, then in overlapping pieces along the
    #: slice axis, before it fails (:func:`segnode.engines.trained.memory_ladder`).
    gpu_memory_limit: int = setting(0, 0)
    #: Jobs in progress at once (0: three for a GPU engine, two for ``onnxruntime`` and
    #: ``openvino``, which share the CPU with the work around the model). While one
    #: job's model runs, the next jobs' volumes are assembled and their results prepared, and
    #: the last ones' results encoded and written; the models run one job at a time, the most
    #: urgent waiting job first; with every lane busy, one more lane takes a job more urgent
    #: than all of them (never a routine one). Each job in progress holds its volume and
    #: label map: a job starts only while the estimated peaks of those in progress fit
    #: ``memory_limit``.
    lanes: int = setting(0, 0, 16)
    #: Jobs in their models at once. 2 (the ``torch`` engine on a CUDA GPU): a second job
    #: runs beside the first, each on a CUDA stream of its own, while the GPU's free memory
    #: holds the peak a job of its model reached alone (1.28x -> 1.62x the throughput of one
    #: job at a time in a burst on an H100, docs/performance.md); other engines always run
    #: one job at a time. Default 1: with two, an urgent series shares the GPU with the job
    #: it finds there (on an H200 it then missed its bound of solo time plus one job).
    model_slots: int = setting(1, 1, 4)
    #: Each model's engine in a process of its own (:mod:`segnode.engines.model_process`):
    #: the volume and the label map pass through shared memory, and the model's thread no
    #: longer waits for the interpreter lock that receiving, encoding and sending hold. A
    #: model process that dies fails only the jobs it ran, with that reason, and the next
    #: job starts it again. Recommended for the torch engine on a GPU (a burst on an H200:
    #: 1.58x -> 1.84x one job at a time); no gain for the CPU engines.
    model_process: bool = setting(False)
    #: Seconds a queued job may wait before it starts ahead of more urgent ones (0: never):
    #: urgent series go first, but a routine one is not starved by a stream of them.
    max_wait_s: float = setting(1800.0, 0)


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: the Prometheus endpoint (off by default)."""

    enabled: bool = setting(False)
    host: str = setting("127.0.0.1")
    port: int = setting(9464, 0, 65535)


@dataclass(frozen=True)
class LedgerConfig:
    """``[ledger]``: where the job ledger lives (``docs/operations.md``).

    ``url`` empty: the SQLite file ``ledger.sqlite`` in the data directory (the embedded
    default). ``postgresql+psycopg://user@host/db``: a PostgreSQL database that several nodes
    may share (its schema is made and upgraded by ``segnode db upgrade``; their data
    directories must be on a folder every node mounts at the same path).
    """

    url: str = ""
    #: This node's name in a shared ledger (unique per node); empty: ``<hostname>:<port>``.
    node_name: str = ""
    #: Seconds without a heartbeat after which a node's running jobs and claimed deliveries
    #: are taken over by another node.
    lease_s: float = setting(30.0, 2.0, 3600.0)


@dataclass(frozen=True)
class WebConfig:
    """``[web]``: the web console and HTTP API (off by default; ``docs/web.md``).

    ``token_file`` holds the bearer token that the actions (retry, cancel) need, and that
    every request needs when ``host`` is not a loopback address. ``tls`` serves HTTPS with
    the certificate and key of ``[tls]``.
    """

    enabled: bool = setting(False)
    host: str = "127.0.0.1"
    port: int = 8080
    token_file: Path | None = None
    tls: bool = setting(False)
    preview: bool = setting(True)

    @property
    def loopback(self) -> bool:
        """Whether the console listens on a loopback address only."""
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


#: ``[results] seg_transfer_syntax`` values: Deflated Explicit VR Little Endian, Explicit VR
#: Little Endian (PS3.5 A.5, A.2).
SEG_TRANSFER_SYNTAXES = {"deflated": "1.2.840.10008.1.2.1.99", "explicit": "1.2.840.10008.1.2.1"}


@dataclass(frozen=True)
class ResultsConfig:
    """``[results]``: how the results are encoded."""

    #: "BINARY" (Segmentation Storage, one 1-bit frame per non-empty segment and slice: every
    #: viewer that reads DICOM SEG) or "LABELMAP" (Label Map Segmentation Storage: one 8-bit
    #: frame per non-empty slice holding every segment; read only by recent viewers).
    segmentation_type: str = setting("BINARY", choices=("BINARY", "LABELMAP"))
    #: The SEG's transfer syntax: "deflated" (Deflated Explicit VR Little Endian, PS3.5 A.5:
    #: a 117-segment BINARY SEG of 300 slices is a few MB instead of hundreds) or "explicit"
    #: (Explicit VR Little Endian, uncompressed). A destination that does not accept the
    #: deflated one gets the SEG inflated, in Explicit VR Little Endian; with "explicit" the
    #: outbox does not propose it (docs/integration.md, "SEG encoding").
    seg_transfer_syntax: str = setting("deflated", choices=tuple(SEG_TRANSFER_SYNTAXES))
    #: When the SEG and SR are prepared (everything but what the label map decides):
    #: "concurrent" (on a helper thread while the engine runs) or "before" (in the worker
    #: thread, before the engine runs: the engine's Python then has the GIL to itself, which
    #: a GPU engine launching kernels from Python needs; docs/performance.md).
    prepare: str = setting("concurrent", choices=("concurrent", "before"))
    #: Processes that encode and check the SEGs (:mod:`segnode.node.results.encode_process`),
    #: beside the node's interpreter lock; 0: in the node. Each holds a label map while it
    #: encodes (and about 100 MB besides). With many segments under a burst the SEG's
    #: thousands of short numpy calls wait for the lock the receiving threads hold: 2 for
    #: TotalSegmentator-sized label sets on a GPU (docs/performance.md).
    encode_processes: int = setting(0, 0, 16)

    @property
    def seg_transfer_syntax_uid(self) -> str:
        """The Transfer Syntax UID of :attr:`seg_transfer_syntax`."""
        return SEG_TRANSFER_SYNTAXES[self.seg_transfer_syntax]


ENGINE_LOAD_MODES = ("background", "before")
"""``[model] load``: when the default model's engine loads relative to listening."""


@dataclass(frozen=True)
class ModelConfig(ModelSpec):
    """``[model]``: the default model (a :class:`~segnode.node.modelspec.ModelSpec` named
    ``"default"``) and when its engine loads."""

    name: str = DEFAULT_MODEL_NAME
    manifest: Path = DEFAULT_MODEL
    #: "background" (listen at once; jobs wait until the engine is loaded) or "before" (listen
    #: only once the engine is loaded).
    load: str = setting("background", choices=ENGINE_LOAD_MODES)


@dataclass(frozen=True)
class DispatchConfig:
    """``[dispatch]``: sending results."""

    destinations: tuple[Destination, ...] = ()
    calling_ae: str = "SEGNODE"
    retry_initial_s: float = setting(5.0, 0.01, 3600)
    retry_max_s: float = setting(300.0, 0.01, 86400)
    max_attempts: int = setting(50, 1)
    timeout_s: float = setting(30.0, 1, 3600)
    max_age_s: float = setting(86400.0, 0)
    breaker_failures: int = setting(5, 1)
    breaker_cooldown_s: float = setting(60.0, 0.01, 86400)
    keep_open_s: float = setting(10.0, 0, 3600)


@dataclass(frozen=True)
class Config:
    """The whole configuration."""

    data_dir: Path = Path("data")
    log_level: str = "INFO"
    node: NodeConfig = field(default_factory=NodeConfig)
    series: SeriesConfig = field(default_factory=SeriesConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    job_max_attempts: int = 3
    tls: TLSConfig = field(default_factory=TLSConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    results: ResultsConfig = field(default_factory=ResultsConfig)
    web: WebConfig = field(default_factory=WebConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    routing: Routing = field(default_factory=Routing)

    def configured_destinations(self) -> list[Destination]:
        """Every destination the configuration names: ``dispatch.destinations``, the routing
        rules' destinations, and the return addresses of ``[[node.peers]]``."""
        returns = [p.return_peer for p in self.node.peers if p.return_peer is not None]
        return [*self.dispatch.destinations, *self.routing.destinations(), *returns]

    def with_overrides(
        self,
        *,
        port: int | None = None,
        ae_title: str | None = None,
        data_dir: Path | None = None,
        send_to: list[str] | None = None,
        host: str | None = None,
    ) -> Config:
        """A copy with command-line overrides applied (validated like the file)."""
        node = self.node
        if port is not None:
            node = replace(node, port=_port(port, "--port"))
        if ae_title is not None:
            node = replace(node, ae_title=_ae(ae_title, "--ae-title"))
        if host is not None:
            node = replace(node, host=host)
        dispatch = self.dispatch
        if send_to:
            extra = tuple(parse_peer(s, "--send-to") for s in send_to)
            dispatch = replace(dispatch, destinations=dispatch.destinations + extra)
        return replace(
            self, node=node, dispatch=dispatch, data_dir=data_dir if data_dir else self.data_dir
        )
