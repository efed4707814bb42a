"""Reading ``config.toml`` into the frozen dataclasses of :mod:`segnode.node.config.schema`.

This module owns parsing and validation: :func:`load_config` reads the file,
:func:`from_dict` checks every table and value and builds the
:class:`~segnode.node.config.schema.Config`. An invalid value stops the node at start with a
:class:`~segnode.node.errors.ConfigError` naming the key. The sections that other modules own
are parsed by them: ``[model]`` by :mod:`segnode.node.modelspec`, destinations by
:mod:`segnode.node.routing.destinations`, ``[routing]``, ``[[rules]]`` and ``[models.NAME]`` by
:mod:`segnode.node.routing.rules`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from segnode.node.config.schema import (
    COMPLETION_MODES,
    ENGINE_LOAD_MODES,
    Config,
    DispatchConfig,
    MetricsConfig,
    ModelConfig,
    NodeConfig,
    PeerRule,
    ResultsConfig,
    RetentionConfig,
    SenderPolicy,
    SeriesConfig,
    StreamingConfig,
    TLSConfig,
    WebConfig,
)
from segnode.node.errors import ConfigError
from segnode.node.modelspec import DEFAULT_MODEL_NAME, SPEC_KEYS, ModelSpec, parse_model_spec
from segnode.node.peers import ClientTLS, Peer, parse_peer
from segnode.node.peers import ae_title as _ae
from segnode.node.peers import port as _port
from segnode.node.routing.destinations import PathFn, parse_destination
from segnode.node.routing.rules import parse_routing
from segnode.node.tables import array_of_tables, check_keys, section


def _num(value: Any, key: str, lo: float, hi: float = float("inf")) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"{key}: must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


#: The range of ``node.max_pdu`` (PS3.8 allows any length; below 4 KiB costs speed, above
#: 16 MiB memory per association).
MAX_PDU_RANGE = (4096, 1 << 24)


def _max_pdu(value: Any) -> int:
    """``node.max_pdu``; 0 ("unlimited", the old default) is read as the default, because a
    peer could otherwise make the node buffer gigabytes (the node logs a warning)."""
    n = _int(value, "node.max_pdu", 0, MAX_PDU_RANGE[1])
    if n and n < MAX_PDU_RANGE[0]:
        raise ConfigError(
            f"node.max_pdu: must be between {MAX_PDU_RANGE[0]} and {MAX_PDU_RANGE[1]} bytes"
        )
    return n


def _int(value: Any, key: str, lo: int, hi: int = 2**31) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"{key}: must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {value!r}")
    return value


def _str(value: Any, key: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(value, str) or (choices and value not in choices):
        allowed = f" (one of {', '.join(choices)})" if choices else ""
        raise ConfigError(f"{key}: must be a string{allowed}, got {value!r}")
    return value


def from_dict(raw: dict[str, Any], base_dir: Path | None = None) -> Config:
    """Build a validated :class:`Config` from parsed TOML.

    Relative paths (``data_dir``, ``model.manifest``) are relative to ``base_dir`` (the
    config file's folder) when given, else to the working directory.
    """
    d = Config()
    unknown = set(raw) - {
        "data_dir",
        "log_level",
        "job_max_attempts",
        "node",
        "series",
        "model",
        "dispatch",
        "tls",
        "retention",
        "streaming",
        "metrics",
        "results",
        "web",
        "routing",
        "rules",
        "models",
    }
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(sorted(unknown))}")

    def path(value: Any, key: str) -> Path:
        p = Path(_str(value, key)).expanduser()
        return p if p.is_absolute() or base_dir is None else base_dir / p

    n = section(raw, "node", NodeConfig.__dataclass_fields__)
    allowed = n.get("allowed_calling_aes", [])
    if not isinstance(allowed, list):
        raise ConfigError("node.allowed_calling_aes: must be a list of AE titles")
    node = NodeConfig(
        ae_title=_ae(n.get("ae_title", d.node.ae_title), "node.ae_title"),
        host=_str(n.get("host", d.node.host), "node.host"),
        port=_port(n.get("port", d.node.port), "node.port"),
        max_pdu=_max_pdu(n.get("max_pdu", d.node.max_pdu)),
        allowed_calling_aes=tuple(_ae(a, "node.allowed_calling_aes") for a in allowed),
        other_sop_classes=_str(
            n.get("other_sop_classes", d.node.other_sop_classes),
            "node.other_sop_classes",
            ("ignore", "reject"),
        ),
        max_associations=_int(
            n.get("max_associations", d.node.max_associations), "node.max_associations", 1, 1000
        ),
        max_pending=_int(n.get("max_pending", d.node.max_pending), "node.max_pending", 1, 10000),
        max_pending_per_host=_int(
            n.get("max_pending_per_host", d.node.max_pending_per_host),
            "node.max_pending_per_host",
            1,
            10000,
        ),
        association_request_timeout_s=_num(
            n.get("association_request_timeout_s", d.node.association_request_timeout_s),
            "node.association_request_timeout_s",
            0.1,
            600,
        ),
        network_timeout_s=_num(
            n.get("network_timeout_s", d.node.network_timeout_s), "node.network_timeout_s", 1
        ),
        min_transfer_rate_kib_s=_num(
            n.get("min_transfer_rate_kib_s", d.node.min_transfer_rate_kib_s),
            "node.min_transfer_rate_kib_s",
            0,
        ),
        max_instance_mb=_int(
            n.get("max_instance_mb", d.node.max_instance_mb), "node.max_instance_mb", 1, 65536
        ),
        check_called_ae=_bool(
            n.get("check_called_ae", d.node.check_called_ae), "node.check_called_ae"
        ),
        stop_grace_s=_num(n.get("stop_grace_s", d.node.stop_grace_s), "node.stop_grace_s", 0, 600),
        min_free_disk_mb=_int(
            n.get("min_free_disk_mb", d.node.min_free_disk_mb), "node.min_free_disk_mb", 0
        ),
        staging_pool_mb=_int(
            n.get("staging_pool_mb", d.node.staging_pool_mb), "node.staging_pool_mb", 0, 65536
        ),
        max_series_instances=_int(
            n.get("max_series_instances", d.node.max_series_instances),
            "node.max_series_instances",
            0,
        ),
        max_series_mb=_int(n.get("max_series_mb", d.node.max_series_mb), "node.max_series_mb", 0),
        peers=_peer_rules(n.get("peers", []), path),
    )
    s = section(raw, "series", SeriesConfig.__dataclass_fields__)
    series = SeriesConfig(
        complete_on_release=_bool(s.get("complete_on_release", True), "series.complete_on_release"),
        quiet_period_s=_num(
            s.get("quiet_period_s", d.series.quiet_period_s), "series.quiet_period_s", 0.1, 86400
        ),
        min_slices=_int(s.get("min_slices", d.series.min_slices), "series.min_slices", 2),
        completion=_str(s.get("completion", "auto"), "series.completion", COMPLETION_MODES),
        senders=_senders(s.get("senders", [])),
    )
    m = section(raw, "model", {*SPEC_KEYS, "load"})
    spec = parse_model_spec(DEFAULT_MODEL_NAME, m, "model", path, default_manifest=d.model.manifest)
    model = ModelConfig(
        **{f: getattr(spec, f) for f in ModelSpec.__dataclass_fields__},
        load=_str(m.get("load", d.model.load), "model.load", ENGINE_LOAD_MODES),
    )
    t = section(raw, "dispatch", DispatchConfig.__dataclass_fields__)
    dests = t.get("destinations", [])
    if not isinstance(dests, list):
        raise ConfigError('dispatch.destinations: must be a list of "AE@HOST:PORT" strings')

    def peer_table(x: dict[str, Any], key: str) -> Peer:
        return _tls_dest(x, key, path)

    dispatch = DispatchConfig(
        destinations=tuple(
            parse_destination(x, f"dispatch.destinations[{i}]", path, peer_table)
            for i, x in enumerate(dests)
        ),
        calling_ae=_ae(t.get("calling_ae", node.ae_title), "dispatch.calling_ae"),
        retry_initial_s=_num(
            t.get("retry_initial_s", d.dispatch.retry_initial_s),
            "dispatch.retry_initial_s",
            0.01,
            3600,
        ),
        retry_max_s=_num(
            t.get("retry_max_s", d.dispatch.retry_max_s), "dispatch.retry_max_s", 0.01, 86400
        ),
        max_attempts=_int(
            t.get("max_attempts", d.dispatch.max_attempts), "dispatch.max_attempts", 1
        ),
        timeout_s=_num(t.get("timeout_s", d.dispatch.timeout_s), "dispatch.timeout_s", 1, 3600),
        max_age_s=_num(t.get("max_age_s", d.dispatch.max_age_s), "dispatch.max_age_s", 0),
        breaker_failures=_int(
            t.get("breaker_failures", d.dispatch.breaker_failures), "dispatch.breaker_failures", 1
        ),
        breaker_cooldown_s=_num(
            t.get("breaker_cooldown_s", d.dispatch.breaker_cooldown_s),
            "dispatch.breaker_cooldown_s",
            0.01,
            86400,
        ),
        keep_open_s=_num(
            t.get("keep_open_s", d.dispatch.keep_open_s), "dispatch.keep_open_s", 0, 3600
        ),
    )
    level = _str(raw.get("log_level", "INFO"), "log_level", ("DEBUG", "INFO", "WARNING", "ERROR"))
    tls = _tls(section(raw, "tls", TLSConfig.__dataclass_fields__), path)
    web = _web(
        section(raw, "web", {"enabled", "listen", "token_file", "tls", "preview"}), path, tls
    )
    return Config(
        data_dir=path(raw["data_dir"], "data_dir") if "data_dir" in raw else d.data_dir,
        log_level=level,
        node=node,
        series=series,
        model=model,
        dispatch=dispatch,
        job_max_attempts=_int(raw.get("job_max_attempts", 3), "job_max_attempts", 1, 100),
        tls=tls,
        retention=_retention(section(raw, "retention", RetentionConfig.__dataclass_fields__)),
        streaming=_streaming(section(raw, "streaming", StreamingConfig.__dataclass_fields__)),
        metrics=_metrics(section(raw, "metrics", MetricsConfig.__dataclass_fields__)),
        results=_results(section(raw, "results", ResultsConfig.__dataclass_fields__)),
        web=web,
        routing=parse_routing(raw, path, peer_table),
    )


def _web(t: dict[str, Any], path: PathFn, tls: TLSConfig) -> WebConfig:
    """``[web]``: ``listen = "HOST:PORT"`` (``[::1]:PORT`` for IPv6), a token file, TLS."""
    d = WebConfig()
    listen = _str(t.get("listen", f"{d.host}:{d.port}"), "web.listen")
    m = re.fullmatch(r"(\[[^\]]+\]|[^:\[\]]+):(\d{1,5})", listen.strip())
    if not m:
        raise ConfigError(f'web.listen: expected "HOST:PORT" or "[IPV6]:PORT", got {listen!r}')
    port = int(m.group(2))
    if port > 65535:  # 0 (any free port) is allowed: tests and `segnode serve` log the port
        raise ConfigError(f"web.listen: port must be 0-65535, got {port}")
    token = _str(t.get("token_file", ""), "web.token_file")
    cfg = WebConfig(
        enabled=_bool(t.get("enabled", d.enabled), "web.enabled"),
        host=m.group(1).strip("[]"),
        port=port,
        token_file=path(token, "web.token_file") if token else None,
        tls=_bool(t.get("tls", d.tls), "web.tls"),
        preview=_bool(t.get("preview", d.preview), "web.preview"),
    )
    if not cfg.enabled:
        return cfg
    if cfg.token_file is None and not cfg.loopback:
        raise ConfigError(
            f"web.token_file: required when web.listen is not a loopback address "
            f"({cfg.host}): every request then needs the bearer token"
        )
    if cfg.token_file is not None and not cfg.token_file.is_file():
        raise ConfigError(f"web.token_file: file not found: {cfg.token_file}")
    if cfg.tls:
        for name in ("cert_file", "key_file"):
            p = getattr(tls, name)
            if p is None:
                raise ConfigError(f"tls.{name}: required when web.tls = true")
            if not p.exists():
                raise ConfigError(f"tls.{name}: file not found: {p}")
    return cfg


def _results(t: dict[str, Any]) -> ResultsConfig:
    d = ResultsConfig()
    return ResultsConfig(
        segmentation_type=_str(
            t.get("segmentation_type", d.segmentation_type),
            "results.segmentation_type",
            ("BINARY", "LABELMAP"),
        ),
        prepare=_str(t.get("prepare", d.prepare), "results.prepare", ("concurrent", "before")),
    )


def _tls_dest(x: dict[str, Any], key: str, path: PathFn) -> Peer:
    """A destination given as a table: ``{peer = "AE@HOST:PORT", tls = true, ...}``."""
    known = {
        "peer",
        "tls",
        "ca_file",
        "cert_file",
        "key_file",
        "server_name",
        "verify",
        "reject_superseded",
    }
    check_keys(x, known, f"{key}:")
    if "peer" not in x:
        raise ConfigError(f'{key}: a table destination needs peer = "AE@HOST:PORT"')
    peer = parse_peer(_str(x["peer"], f"{key}.peer"), f"{key}.peer")
    reject = _bool(x.get("reject_superseded", False), f"{key}.reject_superseded")
    peer = replace(peer, reject_superseded=reject)
    if not _bool(x.get("tls", False), f"{key}.tls"):
        if set(x) - {"peer", "tls", "reject_superseded"}:
            raise ConfigError(f"{key}: TLS options given but tls is not true")
        return peer

    def opt(name: str) -> Path | None:
        return path(x[name], f"{key}.{name}") if name in x else None

    tls = ClientTLS(
        ca_file=opt("ca_file"),
        cert_file=opt("cert_file"),
        key_file=opt("key_file"),
        server_name=_str(x["server_name"], f"{key}.server_name") if "server_name" in x else None,
        verify=_bool(x.get("verify", True), f"{key}.verify"),
    )
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError(f"{key}: cert_file and key_file go together")
    for name in ("ca_file", "cert_file", "key_file"):
        p = getattr(tls, name)
        if p is not None and not p.exists():
            raise ConfigError(f"{key}.{name}: file not found: {p}")
    return replace(peer, tls=tls)


_PEER_TLS_KEYS = {"tls", "ca_file", "cert_file", "key_file", "server_name", "verify"}


def _peer_rules(value: Any, path: PathFn) -> tuple[PeerRule, ...]:
    rules = []
    known = {"ae_title", "host", "port", "return_ae_title", *_PEER_TLS_KEYS}
    what = "a table with ae_title and optional host"
    for key, item in array_of_tables(value, "node.peers", known, what):
        if "ae_title" not in item:
            raise ConfigError(f"{key}.ae_title: missing")
        host = item.get("host")
        if host is not None and (not isinstance(host, str) or not host.strip()):
            raise ConfigError(f"{key}.host: must be an address, CIDR network or host name")
        rule = PeerRule(_ae(item["ae_title"], f"{key}.ae_title"), host.strip() if host else None)
        if "port" in item:
            if rule.host is None:
                raise ConfigError(f"{key}.port: a return address needs host (address or name)")
            if "/" in rule.host:
                raise ConfigError(
                    f"{key}.host: with a port it is a return address: an address or a host "
                    f"name, not a network ({rule.host!r})"
                )
            port = _port(item["port"], f"{key}.port")
            ret = _ae(item.get("return_ae_title", rule.ae_title), f"{key}.return_ae_title")
            spec = {k: item[k] for k in _PEER_TLS_KEYS if k in item}
            peer = _tls_dest({"peer": f"{ret}@{rule.host}:{port}", **spec}, key, path)
            rule = replace(rule, port=peer.port, return_ae_title=ret, tls=peer.tls)
        elif set(item) & (_PEER_TLS_KEYS | {"return_ae_title"}):
            raise ConfigError(f"{key}: return_ae_title and TLS options need port")
        rules.append(rule)
    return tuple(rules)


def _tls(t: dict[str, Any], path: PathFn) -> TLSConfig:
    d = TLSConfig()
    enabled = _bool(t.get("enabled", False), "tls.enabled")

    def opt(name: str) -> Path | None:
        return path(t[name], f"tls.{name}") if name in t else None

    cfg = TLSConfig(
        enabled=enabled,
        port=_int(t.get("port", 0), "tls.port", 0, 65535),
        cert_file=opt("cert_file"),
        key_file=opt("key_file"),
        ca_file=opt("ca_file"),
        require_client_cert=_bool(
            t.get("require_client_cert", d.require_client_cert), "tls.require_client_cert"
        ),
        min_version=_str(t.get("min_version", d.min_version), "tls.min_version", ("1.2", "1.3")),
        handshake_timeout_s=_num(
            t.get("handshake_timeout_s", d.handshake_timeout_s), "tls.handshake_timeout_s", 0.1
        ),
    )
    if not enabled:
        return cfg
    for name in ("cert_file", "key_file"):
        if getattr(cfg, name) is None:
            raise ConfigError(f"tls.{name}: required when tls.enabled = true")
    if cfg.require_client_cert and cfg.ca_file is None:
        raise ConfigError("tls.ca_file: required when tls.require_client_cert = true")
    for name in ("cert_file", "key_file", "ca_file"):
        p = getattr(cfg, name)
        if p is not None and not p.exists():
            raise ConfigError(f"tls.{name}: file not found: {p}")
    return cfg


def _senders(raw: Any) -> tuple[SenderPolicy, ...]:
    """Parse ``[[series.senders]]`` (one table per calling AE title)."""
    out: list[SenderPolicy] = []
    known = SenderPolicy.__dataclass_fields__
    what = "a table with ae_title, completion, priority"
    for key, t in array_of_tables(raw, "series.senders", known, what):
        if "ae_title" not in t:
            raise ConfigError(f"{key}.ae_title: missing")
        ae = _ae(t["ae_title"], f"{key}.ae_title")
        if any(p.ae_title == ae for p in out):
            raise ConfigError(f"{key}.ae_title: {ae!r} is listed twice")
        completion = _str(t.get("completion", "auto"), f"{key}.completion", COMPLETION_MODES)
        priority = _int(t.get("priority", 0), f"{key}.priority", -1000, 1000)
        out.append(SenderPolicy(ae_title=ae, completion=completion, priority=priority))
    return tuple(out)


def _streaming(t: dict[str, Any]) -> StreamingConfig:
    d = StreamingConfig()
    return StreamingConfig(
        enabled=_bool(t.get("enabled", d.enabled), "streaming.enabled"),
        workers=_int(t.get("workers", d.workers), "streaming.workers", 1, 64),
        max_memory_mb=_int(t.get("max_memory_mb", d.max_memory_mb), "streaming.max_memory_mb", 0),
        warm_mb=_int(t.get("warm_mb", d.warm_mb), "streaming.warm_mb", 0),
    )


def _metrics(t: dict[str, Any]) -> MetricsConfig:
    d = MetricsConfig()
    return MetricsConfig(
        enabled=_bool(t.get("enabled", d.enabled), "metrics.enabled"),
        host=_str(t.get("host", d.host), "metrics.host"),
        port=_int(t.get("port", d.port), "metrics.port", 0, 65535),
    )


def _retention(t: dict[str, Any]) -> RetentionConfig:
    d = RetentionConfig()
    return RetentionConfig(
        spool_days=_num(t.get("spool_days", d.spool_days), "retention.spool_days", 0),
        check_interval_s=_num(
            t.get("check_interval_s", d.check_interval_s), "retention.check_interval_s", 1
        ),
    )


def load_config(path: Path | None) -> Config:
    """Read ``path`` (or return the defaults when None)."""
    if path is None:
        return from_dict({})
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    return from_dict(raw, base_dir=path.resolve().parent)
