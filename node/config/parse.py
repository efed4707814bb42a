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
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar

import segnode.node.config.schema as schema
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


_DATACLASS_DEFAULT = object()


class _Table:
    """One table's values and the dataclass instance holding its defaults.

    Each reader takes a key's value (the default when the table does not set it), checks it
    and names ``<table>.<key>`` in the :class:`~segnode.node.errors.ConfigError`.
    """

    def __init__(self, name: str, values: Mapping[str, Any], defaults: object = None) -> None:
        self.name = name
        self.values = values
        self.defaults = defaults

    def key(self, key: str) -> str:
        """``key`` as the messages name it."""
        return f"{self.name}.{key}"

    def get(self, key: str, default: Any = _DATACLASS_DEFAULT) -> Any:
        """The table's value of ``key``, else ``default``, else the dataclass's default."""
        if key in self.values:
            return self.values[key]
        return getattr(self.defaults, key) if default is _DATACLASS_DEFAULT else default

    def integer(self, key: str, lo: int, hi: int = 2**31) -> int:
        """``key`` as an integer in ``[lo, hi]``."""
        return _int(self.get(key), self.key(key), lo, hi)

    def number(self, key: str, lo: float, hi: float = float("inf")) -> float:
        """``key`` as a number in ``[lo, hi]``."""
        return _num(self.get(key), self.key(key), lo, hi)

    def flag(self, key: str, default: Any = _DATACLASS_DEFAULT) -> bool:
        """``key`` as true or false."""
        return _bool(self.get(key, default), self.key(key))

    def text(self, key: str, choices: tuple[str, ...] | None = None) -> str:
        """``key`` as a string (one of ``choices`` when given)."""
        return _str(self.get(key), self.key(key), choices)

    def path(self, key: str, path: PathFn) -> Path | None:
        """``key`` as a path resolved by ``path``; None when the table does not set it."""
        return path(self.values[key], self.key(key)) if key in self.values else None


def _settings(t: _Table, cls: type) -> dict[str, Any]:
    """Every field of ``cls`` declared with :func:`~segnode.node.config.schema.setting`, read
    from ``t`` (or its default) and checked as its type and :class:`Accepts` say."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        accepts = f.metadata.get(schema.SETTING)
        if accepts is None:
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        bounds = [b for b in (accepts.low, accepts.high) if b is not None]
        if kind == "bool":
            out[f.name] = t.flag(f.name)
        elif kind == "int":
            out[f.name] = t.integer(f.name, *map(int, bounds))
        elif kind == "float":
            out[f.name] = t.number(f.name, *bounds)
        elif kind == "str":
            out[f.name] = t.text(f.name, accepts.choices or None)
        else:  # a schema error, found by the tests
            raise TypeError(f"{cls.__name__}.{f.name}: a setting of type {kind} cannot be read")
    return out


def _section(raw: Mapping[str, Any], name: str, defaults: Any) -> _Table:
    """``[name]``, its keys among the fields of ``defaults`` (its dataclass's instance)."""
    return _Table(name, section(raw, name, defaults.__dataclass_fields__), defaults)


_S = TypeVar("_S")


def _plain(raw: Mapping[str, Any], name: str, defaults: _S) -> _S:
    """``[name]``, a table of :func:`~segnode.node.config.schema.setting` fields only."""
    return type(defaults)(**_settings(_section(raw, name, defaults), type(defaults)))


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


_TOP_LEVEL_KEYS = {
    "data_dir",
    "log_level",
    "job_max_attempts",
    "node",
    "series",
    "model",
    "dispatch",
    "tls",
    "retention",
    "audit",
    "streaming",
    "metrics",
    "engine",
    "results",
    "web",
    "ledger",
    "routing",
    "rules",
    "models",
}


def from_dict(raw: dict[str, Any], base_dir: Path | None = None) -> schema.Config:
    """Build a validated :class:`~segnode.node.config.schema.Config` from parsed TOML.

    Relative paths (``data_dir``, ``model.manifest``) are relative to ``base_dir`` (the
    config file's folder) when given, else to the working directory.
    """
    d = schema.Config()
    unknown = set(raw) - _TOP_LEVEL_KEYS
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(sorted(unknown))}")

    def path(value: Any, key: str) -> Path:
        p = Path(_str(value, key)).expanduser()
        return p if p.is_absolute() or base_dir is None else base_dir / p

    def peer_table(x: dict[str, Any], key: str) -> Peer:
        return _tls_dest(x, key, path)

    node = _node(_section(raw, "node", d.node), path)
    series = _series(_section(raw, "series", d.series))
    m = section(raw, "model", {*SPEC_KEYS, "load"})
    from segnode.engines.base import available_backends  # as [models.*] tables are checked

    spec = parse_model_spec(
        DEFAULT_MODEL_NAME,
        m,
        "model",
        path,
        default_manifest=d.model.manifest,
        engines=available_backends(),
    )
    model = schema.ModelConfig(
        **{f: getattr(spec, f) for f in ModelSpec.__dataclass_fields__},
        **_settings(_Table("model", m, d.model), schema.ModelConfig),
    )
    dispatch = _dispatch(_section(raw, "dispatch", d.dispatch), node, path, peer_table)
    level = _str(raw.get("log_level", "INFO"), "log_level", ("DEBUG", "INFO", "WARNING", "ERROR"))
    tls = _tls(_section(raw, "tls", d.tls), path)
    web_keys = {"enabled", "listen", "token_file", "tls", "preview"}
    web = _web(_Table("web", section(raw, "web", web_keys), d.web), path, tls)
    return schema.Config(
        data_dir=path(raw["data_dir"], "data_dir") if "data_dir" in raw else d.data_dir,
        log_level=level,
        node=node,
        series=series,
        model=model,
        dispatch=dispatch,
        job_max_attempts=_int(raw.get("job_max_attempts", 3), "job_max_attempts", 1, 100),
        tls=tls,
        retention=_plain(raw, "retention", d.retention),
        audit=_audit(_section(raw, "audit", d.audit), path, tls),
        streaming=_plain(raw, "streaming", d.streaming),
        metrics=_plain(raw, "metrics", d.metrics),
        engine=_plain(raw, "engine", d.engine),
        results=_plain(raw, "results", d.results),
        web=web,
        ledger=_ledger(_section(raw, "ledger", d.ledger), path),
        routing=parse_routing(raw, path, peer_table),
    )


def _node(n: _Table, path: PathFn) -> schema.NodeConfig:
    """``[node]`` and its ``[[node.peers]]``."""
    allowed = n.get("allowed_calling_aes", [])
    if not isinstance(allowed, list):
        raise ConfigError("node.allowed_calling_aes: must be a list of AE titles")
    return schema.NodeConfig(
        ae_title=_ae(n.get("ae_title"), "node.ae_title"),
        port=_port(n.get("port"), "node.port"),
        max_pdu=_max_pdu(n.get("max_pdu")),
        allowed_calling_aes=tuple(_ae(a, "node.allowed_calling_aes") for a in allowed),
        peers=_peer_rules(n.get("peers", []), path),
        **_settings(n, schema.NodeConfig),
    )


def _series(s: _Table) -> schema.SeriesConfig:
    """``[series]`` and its ``[[series.senders]]``."""
    return schema.SeriesConfig(
        senders=_senders(s.get("senders", [])), **_settings(s, schema.SeriesConfig)
    )


def _dispatch(
    t: _Table,
    node: schema.NodeConfig,
    path: PathFn,
    peer_table: Callable[[dict[str, Any], str], Peer],
) -> schema.DispatchConfig:
    """``[dispatch]``; its calling AE title defaults to the node's."""
    dests = t.get("destinations", [])
    if not isinstance(dests, list):
        raise ConfigError('dispatch.destinations: must be a list of "AE@HOST:PORT" strings')
    cfg = schema.DispatchConfig(
        destinations=tuple(
            parse_destination(x, f"dispatch.destinations[{i}]", path, peer_table)
            for i, x in enumerate(dests)
        ),
        calling_ae=_ae(t.get("calling_ae", node.ae_title), "dispatch.calling_ae"),
        **_settings(t, schema.DispatchConfig),
    )
    if cfg.retry_initial_s > cfg.retry_max_s:
        raise ConfigError(
            f"dispatch.retry_initial_s ({cfg.retry_initial_s:g}) is more than "
            f"dispatch.retry_max_s ({cfg.retry_max_s:g}): the first wait cannot exceed the longest"
        )
    return cfg


def _web(t: _Table, path: PathFn, tls: schema.TLSConfig) -> schema.WebConfig:
    """``[web]``: ``listen = "HOST:PORT"`` (``[::1]:PORT`` for IPv6), a token file, TLS."""
    d = schema.WebConfig()
    listen = _str(t.get("listen", f"{d.host}:{d.port}"), "web.listen")
    m = re.fullmatch(r"(\[[^\]]+\]|[^:\[\]]+):(\d{1,5})", listen.strip())
    if not m:
        raise ConfigError(f'web.listen: expected "HOST:PORT" or "[IPV6]:PORT", got {listen!r}')
    port = int(m.group(2))
    if port > 65535:  # 0 (any free port) is allowed: tests and `segnode serve` log the port
        raise ConfigError(f"web.listen: port must be 0-65535, got {port}")
    token = _str(t.get("token_file", ""), "web.token_file")
    cfg = schema.WebConfig(
        host=m.group(1).strip("[]"),
        port=port,
        token_file=path(token, "web.token_file") if token else None,
        **_settings(t, schema.WebConfig),
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
    t = _Table(key, x)
    peer = parse_peer(t.text("peer"), t.key("peer"))
    peer = replace(peer, reject_superseded=t.flag("reject_superseded", False))
    if not t.flag("tls", False):
        if set(x) - {"peer", "tls", "reject_superseded"}:
            raise ConfigError(f"{key}: TLS options given but tls is not true")
        return peer
    tls = ClientTLS(
        ca_file=t.path("ca_file", path),
        cert_file=t.path("cert_file", path),
        key_file=t.path("key_file", path),
        server_name=t.text("server_name") if "server_name" in x else None,
        verify=t.flag("verify", True),
    )
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError(f"{key}: cert_file and key_file go together")
    for name in ("ca_file", "cert_file", "key_file"):
        p = getattr(tls, name)
        if p is not None and not p.exists():
            raise ConfigError(f"{key}.{name}: file not found: {p}")
    return replace(peer, tls=tls)


_PEER_TLS_KEYS = {"tls", "ca_file", "cert_file", "key_file", "server_name", "verify"}


def _peer_rules(value: Any, path: PathFn) -> tuple[schema.PeerRule, ...]:
    rules = []
    known = {"ae_title", "host", "port", "return_ae_title", *_PEER_TLS_KEYS}
    what = "a table with ae_title and optional host"
    for key, item in array_of_tables(value, "node.peers", known, what):
        if "ae_title" not in item:
            raise ConfigError(f"{key}.ae_title: missing")
        host = item.get("host")
        if host is not None and (not isinstance(host, str) or not host.strip()):
            raise ConfigError(f"{key}.host: must be an address, CIDR network or host name")
        rule = schema.PeerRule(
            _ae(item["ae_title"], f"{key}.ae_title"), host.strip() if host else None
        )
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


def _tls(t: _Table, path: PathFn) -> schema.TLSConfig:
    cfg = schema.TLSConfig(
        cert_file=t.path("cert_file", path),
        key_file=t.path("key_file", path),
        ca_file=t.path("ca_file", path),
        **_settings(t, schema.TLSConfig),
    )
    if not cfg.enabled:
        return cfg
    for name in ("cert_file", "key_file"):
        if getattr(cfg, name) is None:
            raise ConfigError(f"tls.{name}: required when tls.enabled = true")
    if cfg.require_client_cert and cfg.ca_file is None:
        raise ConfigError("tls.ca_file: required when tls.require_client_cert = true")
    _files_found(cfg, "tls")
    return cfg


def _audit(t: _Table, path: PathFn, tls: schema.TLSConfig) -> schema.AuditConfig:
    """``[audit]``: its destinations checked (a URL each), the TLS files found."""
    from segnode.node.audit.syslog import parse_destination

    raw = t.get("destinations", [])
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise ConfigError("audit.destinations: must be a list of strings (URLs)")
    destinations: list[str] = []
    for k, url in enumerate(raw):
        if url.startswith("file:") and not url.startswith("file://"):
            url = "file://" + str(path(url[len("file:") :], f"audit.destinations[{k}]"))
        try:
            parse_destination(url)
        except ValueError as exc:
            raise ConfigError(f"audit.destinations[{k}]: {exc}") from None
        destinations.append(url)
    cfg = schema.AuditConfig(
        destinations=tuple(destinations),
        cert_file=t.path("cert_file", path) or tls.cert_file,
        key_file=t.path("key_file", path) or tls.key_file,
        ca_file=t.path("ca_file", path),
        **_settings(t, schema.AuditConfig),
    )
    if not cfg.enabled:
        return cfg
    if not cfg.destinations:
        raise ConfigError("audit.destinations: at least one is required when audit.enabled")
    if any(d.startswith("syslog+tls://") for d in cfg.destinations) and cfg.ca_file is None:
        raise ConfigError("audit.ca_file: required for a syslog+tls:// destination")
    if (cfg.cert_file is None) != (cfg.key_file is None):
        raise ConfigError("audit.cert_file and audit.key_file: give both or neither")
    _files_found(cfg, "audit")
    return cfg


def _files_found(cfg: schema.TLSConfig | schema.AuditConfig, table: str) -> None:
    """Each of the table's ``cert_file``, ``key_file`` and ``ca_file`` that is set exists."""
    for name in ("cert_file", "key_file", "ca_file"):
        p = getattr(cfg, name)
        if p is not None and not p.exists():
            raise ConfigError(f"{table}.{name}: file not found: {p}")


def _senders(raw: Any) -> tuple[schema.SenderPolicy, ...]:
    """Parse ``[[series.senders]]`` (one table per calling AE title)."""
    out: list[schema.SenderPolicy] = []
    known = schema.SenderPolicy.__dataclass_fields__
    what = "a table with ae_title, completion, priority"
    for key, t in array_of_tables(raw, "series.senders", known, what):
        if "ae_title" not in t:
            raise ConfigError(f"{key}.ae_title: missing")
        ae = _ae(t["ae_title"], f"{key}.ae_title")
        if any(p.ae_title == ae for p in out):
            raise ConfigError(f"{key}.ae_title: {ae!r} is listed twice")
        policy = _Table(key, t, schema.SenderPolicy(ae_title=ae))
        out.append(schema.SenderPolicy(ae_title=ae, **_settings(policy, schema.SenderPolicy)))
    return tuple(out)


def _ledger(t: _Table, path: PathFn) -> schema.LedgerConfig:
    """``[ledger]``: empty, ``sqlite:///FILE`` (relative to the config file) or PostgreSQL."""
    name = t.text("node_name").strip()
    if len(name) > 128 or any(not c.isprintable() for c in name):
        raise ConfigError("ledger.node_name: at most 128 printable characters")
    base = schema.LedgerConfig(node_name=name, **_settings(t, schema.LedgerConfig))
    url = t.text("url").strip()
    if not url:
        return base
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme.startswith("sqlite"):
        file = url.split(":///", 1)[1] if ":///" in url else ""
        if not file:
            raise ConfigError("ledger.url: a SQLite URL names a file: sqlite:///path/ledger.sqlite")
        return replace(base, url=f"sqlite:///{path(file, t.key('url'))}")
    if scheme not in ("postgresql", "postgresql+psycopg"):
        raise ConfigError(
            "ledger.url: must be empty (SQLite in the data directory), sqlite:///FILE or "
            f"postgresql+psycopg://user@host[:port]/database, got {scheme or url!r}"
        )
    # psycopg 3 is the driver segnode is tested with (pip install segnode[postgres]).
    return replace(base, url=url.replace("postgresql://", "postgresql+psycopg://", 1))


def load_config(path: Path | None) -> schema.Config:
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
