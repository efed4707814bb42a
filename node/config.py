"""Configuration: ``config.toml`` parsed once into frozen, validated dataclasses.

Every key is documented in the repository's ``config.toml``, which holds the defaults. An
invalid value stops the node at start with a :class:`~node.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from node.errors import ConfigError

_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = _ROOT / "engines" / "models" / "tissue" / "tissue.json"
#: The documented default configuration at the repository root.
ROOT_CONFIG = _ROOT / "config.toml"
_AE_OK = re.compile(r"^[\x20-\x5b\x5d-\x7e]{1,16}$")  # PS3.5 §6.2 AE: no backslash, no controls


@dataclass(frozen=True)
class Peer:
    """A remote DICOM application entity."""

    ae_title: str
    host: str
    port: int

    @property
    def name(self) -> str:
        """``AE@host:port``: the destination's name in the ledger."""
        return f"{self.ae_title}@{self.host}:{self.port}"


@dataclass(frozen=True)
class NodeConfig:
    """``[node]``: the listening application entity."""

    ae_title: str = "SEGNODE"
    host: str = "127.0.0.1"
    port: int = 11112
    max_pdu: int = 0
    allowed_calling_aes: tuple[str, ...] = ()
    other_sop_classes: str = "ignore"
    max_associations: int = 16
    network_timeout_s: float = 60.0


@dataclass(frozen=True)
class SeriesConfig:
    """``[series]``: when a series is complete."""

    complete_on_release: bool = True
    quiet_period_s: float = 30.0
    min_slices: int = 2


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: which model runs on which backend."""

    manifest: Path = DEFAULT_MODEL
    engine: str = "onnxruntime"
    threads: int = 0
    precision: str = "fp32"


@dataclass(frozen=True)
class DispatchConfig:
    """``[dispatch]``: sending results."""

    destinations: tuple[Peer, ...] = ()
    calling_ae: str = "SEGNODE"
    retry_initial_s: float = 5.0
    retry_max_s: float = 300.0
    max_attempts: int = 50
    timeout_s: float = 30.0


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


def _ae(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _AE_OK.match(value) or not value.strip():
        raise ConfigError(f"{key}: AE title must be 1-16 printable characters, got {value!r}")
    return value.strip()


def _port(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ConfigError(f"{key}: port must be an integer 1-65535, got {value!r}")
    return value


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


def parse_peer(text: str, key: str = "destination") -> Peer:
    """Parse ``AE@HOST:PORT``."""
    m = re.fullmatch(r"([^@]{1,16})@(\[[^\]]+\]|[^:@]+):(\d{1,5})", text)
    if not m:
        raise ConfigError(f"{key}: expected AE@HOST:PORT, got {text!r}")
    host = m.group(2).strip("[]")
    return Peer(_ae(m.group(1), key), host, _port(int(m.group(3)), key))


def _table(raw: dict[str, Any], name: str, known: set[str]) -> dict[str, Any]:
    t = raw.get(name, {})
    if not isinstance(t, dict):
        raise ConfigError(f"[{name}] must be a table")
    unknown = set(t) - known
    if unknown:
        raise ConfigError(f"[{name}] unknown key(s): {', '.join(sorted(unknown))}")
    return t


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
    }
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(sorted(unknown))}")

    def path(value: Any, key: str) -> Path:
        p = Path(_str(value, key)).expanduser()
        return p if p.is_absolute() or base_dir is None else base_dir / p

    n = _table(raw, "node", set(NodeConfig.__dataclass_fields__))
    allowed = n.get("allowed_calling_aes", [])
    if not isinstance(allowed, list):
        raise ConfigError("node.allowed_calling_aes: must be a list of AE titles")
    node = NodeConfig(
        ae_title=_ae(n.get("ae_title", d.node.ae_title), "node.ae_title"),
        host=_str(n.get("host", d.node.host), "node.host"),
        port=_port(n.get("port", d.node.port), "node.port"),
        max_pdu=_int(n.get("max_pdu", d.node.max_pdu), "node.max_pdu", 0),
        allowed_calling_aes=tuple(_ae(a, "node.allowed_calling_aes") for a in allowed),
        other_sop_classes=_str(
            n.get("other_sop_classes", d.node.other_sop_classes),
            "node.other_sop_classes",
            ("ignore", "reject"),
        ),
        max_associations=_int(
            n.get("max_associations", d.node.max_associations), "node.max_associations", 1, 1000
        ),
        network_timeout_s=_num(
            n.get("network_timeout_s", d.node.network_timeout_s), "node.network_timeout_s", 1
        ),
    )
    s = _table(raw, "series", set(SeriesConfig.__dataclass_fields__))
    series = SeriesConfig(
        complete_on_release=_bool(s.get("complete_on_release", True), "series.complete_on_release"),
        quiet_period_s=_num(
            s.get("quiet_period_s", d.series.quiet_period_s), "series.quiet_period_s", 0.1, 86400
        ),
        min_slices=_int(s.get("min_slices", d.series.min_slices), "series.min_slices", 2),
    )
    m = _table(raw, "model", set(ModelConfig.__dataclass_fields__))
    model = ModelConfig(
        manifest=path(m["manifest"], "model.manifest") if "manifest" in m else d.model.manifest,
        engine=_str(m.get("engine", d.model.engine), "model.engine"),
        threads=_int(m.get("threads", 0), "model.threads", 0, 256),
        precision=_str(m.get("precision", "fp32"), "model.precision", ("fp32", "fp16")),
    )
    if not model.manifest.exists():
        raise ConfigError(f"model.manifest: file not found: {model.manifest}")
    t = _table(raw, "dispatch", set(DispatchConfig.__dataclass_fields__))
    dests = t.get("destinations", [])
    if not isinstance(dests, list):
        raise ConfigError('dispatch.destinations: must be a list of "AE@HOST:PORT" strings')
    dispatch = DispatchConfig(
        destinations=tuple(
            parse_peer(x, f"dispatch.destinations[{i}]") if isinstance(x, str) else _bad_dest(i, x)
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
    )
    level = _str(raw.get("log_level", "INFO"), "log_level", ("DEBUG", "INFO", "WARNING", "ERROR"))
    return Config(
        data_dir=path(raw["data_dir"], "data_dir") if "data_dir" in raw else d.data_dir,
        log_level=level,
        node=node,
        series=series,
        model=model,
        dispatch=dispatch,
        job_max_attempts=_int(raw.get("job_max_attempts", 3), "job_max_attempts", 1, 100),
    )


def _bad_dest(i: int, x: Any) -> Peer:
    raise ConfigError(f'dispatch.destinations[{i}]: expected "AE@HOST:PORT", got {x!r}')


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
