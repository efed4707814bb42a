"""The node's configuration: ``config.toml`` parsed once into frozen, validated dataclasses.

:mod:`~segnode.node.config.schema` holds the dataclasses (what each table holds, with its
defaults); :mod:`~segnode.node.config.parse` reads and validates the file into them. This
package re-exports the public names of both, so ``from segnode.node.config import Config,
load_config`` is the way in.
"""

from segnode.node.config.parse import MAX_PDU_RANGE, from_dict, load_config
from segnode.node.config.schema import (
    COMPLETION_MODES,
    DEFAULT_MODEL,
    ENGINE_LOAD_MODES,
    ROOT_CONFIG,
    Config,
    DispatchConfig,
    LedgerConfig,
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
    is_loopback,
)
from segnode.node.errors import ConfigError

__all__ = [
    "COMPLETION_MODES",
    "DEFAULT_MODEL",
    "ENGINE_LOAD_MODES",
    "MAX_PDU_RANGE",
    "ROOT_CONFIG",
    "Config",
    "ConfigError",
    "DispatchConfig",
    "LedgerConfig",
    "MetricsConfig",
    "ModelConfig",
    "NodeConfig",
    "PeerRule",
    "ResultsConfig",
    "RetentionConfig",
    "SenderPolicy",
    "SeriesConfig",
    "StreamingConfig",
    "TLSConfig",
    "WebConfig",
    "from_dict",
    "is_loopback",
    "load_config",
]
