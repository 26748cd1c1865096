"""The environment, parsed once into one frozen, validated configuration.

Every ``VLLM_CAMP2P_*`` variable the package reads is declared in
:data:`ENV_VARS`; :func:`load_config` is the only place that reads them.
A malformed value is a :class:`ConfigError` naming the variable and the
value, never a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

Backend = Literal["auto", "npu", "cuda", "cpu"]
#: The rollout modes: ``overlap`` (side streams), ``reorder`` (the overlap's
#: issue order on the compute stream only), ``parity`` (the session engaged,
#: every op on the compute stream in upstream's order). See docs/design.md.
Mode = Literal["overlap", "reorder", "parity"]

ENV_SWITCH = "VLLM_CAMP2P_MULTISTREAM"
ENV_A2E = "VLLM_CAMP2P_MULTISTREAM_A2E"
ENV_E2A = "VLLM_CAMP2P_MULTISTREAM_E2A"
ENV_MIN_STAGES = "VLLM_CAMP2P_MULTISTREAM_MIN_STAGES"
ENV_GRAPH = "VLLM_CAMP2P_MULTISTREAM_GRAPH"
ENV_BACKEND = "VLLM_CAMP2P_MULTISTREAM_BACKEND"
ENV_STRICT = "VLLM_CAMP2P_MULTISTREAM_STRICT"
ENV_WATCHDOG = "VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S"
ENV_ADAPTIVE = "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE"
ENV_REPROBE = "VLLM_CAMP2P_MULTISTREAM_REPROBE_EVERY"
ENV_MODE = "VLLM_CAMP2P_MULTISTREAM_MODE"
ENV_METRICS_PORT = "VLLM_CAMP2P_MULTISTREAM_METRICS_PORT"
ENV_SUMMARY = "VLLM_CAMP2P_MULTISTREAM_SUMMARY_S"

#: Every variable this package reads, with a one-line description. vLLM's
#: environment registry is told about exactly these names (see plugin.py).
ENV_VARS: dict[str, str] = {
    ENV_SWITCH: "Master switch for FFN-side CAMP2P A2E/E2A multi-stream overlap.",
    ENV_A2E: "Run A2E (receive from attention) on per-stage side streams.",
    ENV_E2A: "Run E2A (send to attention) on per-stage side streams.",
    ENV_MIN_STAGES: "Fewest micro-batch stages in a step for the overlap to engage.",
    ENV_GRAPH: "Also engage inside graph capture (ACL graph / CUDA graph).",
    ENV_BACKEND: "Stream backend: auto (from the runner's device), npu, cuda or cpu.",
    ENV_STRICT: "Raise instead of logging when the patch layer refuses.",
    ENV_WATCHDOG: "Seconds after which a step that has not finished logs a stall report.",
    ENV_ADAPTIVE: "Measure overlapped and serial steps per shape and engage only where the overlap is faster.",
    ENV_REPROBE: (
        "With adaptive engage: run a probe round of the path not chosen every this many steps of a shape"
        " (up to 8 times as far apart while the probes clearly lose)."
    ),
    ENV_MODE: "Rollout mode: overlap (default), reorder (overlap issue order, one stream) or parity (upstream order).",
    ENV_METRICS_PORT: "Opt-in: serve this process's step metrics over HTTP on this port (0: any free port).",
    ENV_SUMMARY: "Seconds between one-line step summaries in the log (0: none).",
}

#: CAMP2P has one HCCL group per stage: afd, afd1, afd2.
MAX_STAGES = 3
#: Bounds of the re-probe interval (steps of one shape bucket).
MIN_REPROBE, MAX_REPROBE = 2, 1_000_000

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_BACKENDS: tuple[str, ...] = ("auto", "npu", "cuda", "cpu")
MODES: tuple[str, ...] = ("overlap", "reorder", "parity")
#: Default seconds between the periodic one-line summaries.
DEFAULT_SUMMARY_S = 60.0


class ConfigError(ValueError):
    """An environment variable holds a value this package does not accept."""


@dataclass(frozen=True)
class OverlapConfig:
    """What the environment asked for. Immutable; build a new one with
    :meth:`with_overrides`."""

    enabled: bool = False
    a2e_on_side_stream: bool = True
    e2a_on_side_stream: bool = True
    min_stages: int = 2
    graph: bool = False
    backend: Backend = "auto"
    strict: bool = False
    watchdog_s: float | None = None
    adaptive: bool = True
    reprobe_every: int = 64
    mode: Mode = "overlap"
    #: Port of the opt-in per-process metrics endpoint (None: off; 0: any free port).
    metrics_port: int | None = None
    #: Seconds between one-line summaries in the log (0: none).
    summary_s: float = DEFAULT_SUMMARY_S
    #: Variables that were set, as read (for logs and ``doctor``).
    raw: Mapping[str, str] = field(default_factory=dict, compare=False)

    def with_overrides(self, **changes: object) -> OverlapConfig:
        """A copy with the given fields changed (used by tests and the bench)."""
        cfg = replace(self, **changes)  # type: ignore[arg-type]
        _check_ranges(cfg)
        return cfg


def _parse_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def _parse_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _parse_seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive, finite number of seconds")
    return value


def _parse_choice(env: Mapping[str, str], name: str, choices: Sequence[str], default: str) -> str:
    """One of ``choices`` (case-insensitive), ``default`` when unset or blank."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return value


def _parse_port(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a TCP port number") from None


def _parse_summary(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return DEFAULT_SUMMARY_S
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be 0 (off) or a positive, finite number of seconds")
    return value


def _check_ranges(cfg: OverlapConfig) -> None:
    if not 1 <= cfg.min_stages <= MAX_STAGES:
        raise ConfigError(
            f"{ENV_MIN_STAGES}={cfg.min_stages} is out of range 1..{MAX_STAGES} (CAMP2P has {MAX_STAGES} stage groups)"
        )
    if not MIN_REPROBE <= cfg.reprobe_every <= MAX_REPROBE:
        raise ConfigError(f"{ENV_REPROBE}={cfg.reprobe_every} is out of range {MIN_REPROBE}..{MAX_REPROBE}")
    if cfg.backend not in _BACKENDS:
        raise ConfigError(f"{ENV_BACKEND}={cfg.backend!r} is not one of {', '.join(_BACKENDS)}")
    if cfg.mode not in MODES:
        raise ConfigError(f"{ENV_MODE}={cfg.mode!r} is not one of {', '.join(MODES)}")
    if cfg.metrics_port is not None and not 0 <= cfg.metrics_port <= 65535:
        raise ConfigError(f"{ENV_METRICS_PORT}={cfg.metrics_port} is out of range 0..65535")


def load_config(env: Mapping[str, str] | None = None) -> OverlapConfig:
    """Parse the environment (``os.environ`` by default) into a config.

    Raises :class:`ConfigError` for any malformed value.
    """
    env = os.environ if env is None else env
    cfg = OverlapConfig(
        enabled=_parse_bool(env, ENV_SWITCH, False),
        a2e_on_side_stream=_parse_bool(env, ENV_A2E, True),
        e2a_on_side_stream=_parse_bool(env, ENV_E2A, True),
        min_stages=_parse_int(env, ENV_MIN_STAGES, 2),
        graph=_parse_bool(env, ENV_GRAPH, False),
        backend=_parse_choice(env, ENV_BACKEND, _BACKENDS, "auto"),  # type: ignore[arg-type]
        strict=_parse_bool(env, ENV_STRICT, False),
        watchdog_s=_parse_seconds(env, ENV_WATCHDOG),
        adaptive=_parse_bool(env, ENV_ADAPTIVE, True),
        reprobe_every=_parse_int(env, ENV_REPROBE, 64),
        mode=_parse_choice(env, ENV_MODE, MODES, "overlap"),  # type: ignore[arg-type]
        metrics_port=_parse_port(env, ENV_METRICS_PORT),
        summary_s=_parse_summary(env, ENV_SUMMARY),
        raw={k: env[k] for k in ENV_VARS if k in env},
    )
    _check_ranges(cfg)
    return cfg


def strict_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether strict mode is asked for, tolerating a malformed switch elsewhere.

    Used to decide whether a :class:`ConfigError` itself should raise.
    """
    env = os.environ if env is None else env
    try:
        return _parse_bool(env, ENV_STRICT, False)
    except ConfigError:
        return False
