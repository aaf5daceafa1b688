"""The gateway's YAML configuration: one validated, immutable object.

Everything the service needs is read from one file and validated up front (unknown keys are
errors, so a typo fails loudly instead of being ignored). ``load_config`` turns a path into a
``GatewayConfig`` or raises ``ConfigError`` whose message names the failing location.

The sections live in modules of their own: ``fields`` (what every section is built on),
``pools``, ``routing``, ``access`` (keys, tenants, the admin token), ``process`` (the sections bound
to the process: server, engines, state, telemetry, epp), ``schema`` (``GatewayConfig`` and the
smaller sections) and ``loading`` (YAML to a validated config); ``reload`` applies edits
while serving and ``flags`` makes a config from ``pdgate serve``'s flags. Everything public is
importable from here.
"""

from __future__ import annotations

from gateway.config.access import AdminConfig, AuthConfig, FairnessConfig, KeyEntry, PriorityClass, TenantConfig
from gateway.config.fields import Loc, read_file
from gateway.config.loading import ConfigError, DuplicateKeyError, UniqueKeyLoader, load_config, parse_config
from gateway.config.pools import DiscoveryConfig, EndpointConfig, HealthConfig, OutlierConfig, PoolConfig, PoolsConfig
from gateway.config.process import (
    EnginesConfig,
    EppConfig,
    ServerConfig,
    StateConfig,
    TelemetryConfig,
    TracingConfig,
)
from gateway.config.routing import (
    MigrationConfig,
    PolicySpec,
    PoolRoutingConfig,
    PrefixConfig,
    RoutingConfig,
    ScorerSpec,
    SignalsConfig,
    TiersConfig,
)
from gateway.config.schema import (
    AdapterConfig,
    AdmissionConfig,
    FailoverConfig,
    GatewayConfig,
    LimitsConfig,
    LoraConfig,
    ModelConfig,
    PinnedFiles,
    PlannerConfig,
    PlannerSLO,
    TimeoutsConfig,
    TokenizerConfig,
    access_switched_off,
)

__all__ = [
    "AdapterConfig",
    "AdminConfig",
    "AdmissionConfig",
    "AuthConfig",
    "ConfigError",
    "DiscoveryConfig",
    "DuplicateKeyError",
    "EndpointConfig",
    "EnginesConfig",
    "EppConfig",
    "FailoverConfig",
    "FairnessConfig",
    "GatewayConfig",
    "HealthConfig",
    "KeyEntry",
    "LimitsConfig",
    "Loc",
    "LoraConfig",
    "MigrationConfig",
    "ModelConfig",
    "OutlierConfig",
    "PinnedFiles",
    "PlannerConfig",
    "PlannerSLO",
    "PolicySpec",
    "PoolConfig",
    "PoolRoutingConfig",
    "PoolsConfig",
    "PrefixConfig",
    "PriorityClass",
    "RoutingConfig",
    "ScorerSpec",
    "ServerConfig",
    "SignalsConfig",
    "StateConfig",
    "TelemetryConfig",
    "TenantConfig",
    "TiersConfig",
    "TimeoutsConfig",
    "TokenizerConfig",
    "TracingConfig",
    "UniqueKeyLoader",
    "access_switched_off",
    "load_config",
    "parse_config",
    "read_file",
]
