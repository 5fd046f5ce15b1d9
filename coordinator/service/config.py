"""The coordinator's configuration: one dataclass, validated, loadable from YAML, env, CLI.

Precedence: CLI > env (``RESIHP_COORDINATOR_<FIELD>`` and the job-wide ``RESIHP_JOB`` /
``RESIHP_TOKEN``) > YAML file > defaults.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    pass


@dataclass
class CoordinatorConfig:
    job: str = "job"
    run_dir: str = "resihp-run"  # journal, event log, address file live here
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 0  # 0 = world_size / (tp * pp)
    model: str = "gpt-tiny"  # preset name (coordinator/model/spec.py) or a JSON/YAML model file
    microbatches: int = 0  # global micro-batches per iteration; 0 = 2 per replica
    plan_file: str = ""  # an explicit initial plan (JSON); overrides tp/pp/dp
    tokens_per_microbatch: int = 0
    device_flops: float = 0.0  # planner's sustained FLOP/s of one healthy device; 0 = its default (H100-class)
    cluster_file: str = ""  # a cluster JSON (coordinator/model/cluster.py) whose links and FLOP/s the planner uses
    rank_nodes: str = ""  # node name of every rank, comma-separated (for the detector's localisation)
    host: str = "127.0.0.1"  # the agents' side; 0.0.0.0 for multi-node
    port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # -1 disables /metrics
    token: str = ""
    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    engine: str = "auto"  # auto | real | rules
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    join_grace_s: float = 2.0
    # an agent whose stream ended is given this long to come back (its launcher restarts it)
    # before its ranks' silence counts against them: an agent's death is not its ranks' death
    agent_grace_s: float = 30.0
    ack_timeout_s: float = 30.0
    apply_margin: int = 2  # apply_at >= newest reported iteration + margin ...
    apply_lead_s: float = 0.5  # ... and at least this far ahead at the current iteration time
    tick_s: float = 0.1
    auto_reconfigure: bool = True
    # after a switch the planner chose on its own, compare measured iteration times and undo it
    # when it runs slower than the plan it replaced by more than audit_margin (coordinator/planner/audit.py)
    plan_audit: bool = True
    audit_margin: float = 0.2
    max_workers: int = 64
    policy: dict[str, str] = field(default_factory=dict)  # engine policy overrides
    # CPU niceness the coordinator process adds at start (0..19; env RESIHP_COORDINATOR_NICE): where
    # it shares cores with training ranks it then runs in their idle time, not on their critical path
    nice: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.plan_file:
            dp = self.dp or self.world_size // (self.tp * self.pp)
            if dp < 1 or self.tp * self.pp * dp != self.world_size:
                raise ConfigError(
                    f"tp × pp × dp = {self.tp}×{self.pp}×{dp} does not equal world_size {self.world_size}; "
                    "choose degrees whose product is the number of ranks"
                )
            self.dp = dp
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "join_grace_s", "agent_grace_s", "ack_timeout_s",
                     "tick_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        if not (isinstance(self.audit_margin, (int, float)) and math.isfinite(self.audit_margin)
                and self.audit_margin >= 0):
            raise ConfigError(f"audit_margin must be a number >= 0 (0.2: undo a re-plan 20 % slower than the plan "
                              f"it replaced), got {self.audit_margin!r}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s})"
            )
        if self.apply_margin < 1:
            raise ConfigError(f"apply_margin must be >= 1 iteration, got {self.apply_margin}")
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"nice must be 0..19 (niceness to add; 0 = unchanged), got {self.nice}")
        if self.engine not in ("auto", "real", "rules"):
            raise ConfigError(f"engine must be auto, real or rules, got {self.engine!r}")
        if not (0 <= self.port < 65536):
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.rank_nodes and len(self.rank_nodes.split(",")) != self.world_size:
            raise ConfigError(f"rank_nodes lists {len(self.rank_nodes.split(','))} nodes for {self.world_size} ranks")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both tls_cert and tls_key")

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)


def _coerce(name: str, kind: Any, value: Any) -> Any:
    try:
        if kind in (bool, "bool"):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind in (int, "int"):
            return int(value)
        if kind in (float, "float"):
            return float(value)
        if kind in (str, "str"):
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {getattr(kind, '__name__', kind)}, got {value!r}") from None
    return value


def load_config(file: str | None, env: Mapping[str, str], cli: Mapping[str, Any]) -> CoordinatorConfig:
    values: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(CoordinatorConfig)}
    if file:
        import yaml

        try:
            data = yaml.safe_load(Path(file).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {file} must hold a mapping of field: value")
        unknown = sorted(set(data) - set(types))
        if unknown:
            raise ConfigError(f"config file {file}: unknown fields {unknown}; known: {sorted(types)}")
        values.update(data)
    for name in types:
        key = f"RESIHP_COORDINATOR_{name.upper()}"
        if key in env:
            values[name] = env[key]
    if env.get("RESIHP_JOB"):
        values.setdefault("job", env["RESIHP_JOB"])
    if env.get("RESIHP_TOKEN"):
        values["token"] = env["RESIHP_TOKEN"]
    values.update({k: v for k, v in cli.items() if v is not None})
    for name, value in list(values.items()):
        if name != "policy":
            values[name] = _coerce(name, types[name], value)
    return CoordinatorConfig(**values)


def env_flag(name: str, default: str = "") -> str:
    return os.environ.get(name, default)
