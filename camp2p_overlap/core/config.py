"""The environment, parsed once into one frozen, validated configuration.

Every ``VLLM_CAMP2P_*`` variable the package reads is a row of
:data:`camp2p_overlap.core.env_vars.TABLE` (name, parser, default, range,
help); :func:`load_config` is the only place that reads them. A malformed
value is a :class:`ConfigError` naming the variable and the value, never a
silent default; every malformed variable is named at once (one problem per
variable, in the table's order: :attr:`ConfigError.problems`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from camp2p_overlap.core.env_vars import BY_NAME, DEFAULTS, ENV_LAYOUT, ENV_MODE, ENV_STRICT, TABLE, BadValue

__all__ = [
    "ENV_VARS",
    "LAYOUTS",
    "MODES",
    "Backend",
    "ConfigError",
    "LayoutName",
    "Mode",
    "OverlapConfig",
    "load_config",
    "strict_requested",
]

Backend = Literal["auto", "npu", "cuda", "cpu"]
#: The rollout modes (what each does: the table's VLLM_CAMP2P_MULTISTREAM_MODE choices).
Mode = Literal["overlap", "reorder", "parity"]
GraphMode = Literal["0", "1", "adaptive"]
#: The rollout modes, in the order errors list them (the table's choices).
MODES: tuple[str, ...] = BY_NAME[ENV_MODE].values
#: The stream layouts of the ``overlap`` mode (what each does: the table's VLLM_CAMP2P_MULTISTREAM_LAYOUT choices).
LayoutName = Literal["compute-side", "comm-side"]
#: The stream layouts, in the order errors list them (the table's choices).
LAYOUTS: tuple[str, ...] = BY_NAME[ENV_LAYOUT].values

#: Every variable this package reads -> its help (plain text). vLLM's
#: environment registry is told about exactly these names (see plugin.py).
ENV_VARS: dict[str, str] = {v.name: v.meaning(markdown=False) for v in TABLE}


class ConfigError(ValueError):
    """One or more environment variables hold a value this package does not
    accept. :attr:`problems` names each, one message per variable in the
    table's order; the error's text is all of them joined by ``"; "``."""

    def __init__(self, problems: Sequence[str] | str) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class OverlapConfig:
    """What the environment asked for. Immutable; build a new one with
    :meth:`with_overrides`. Each field's default is its variable's in
    :data:`camp2p_overlap.core.env_vars.TABLE`."""

    enabled: bool = DEFAULTS["enabled"]
    a2e_on_side_stream: bool = DEFAULTS["a2e_on_side_stream"]
    e2a_on_side_stream: bool = DEFAULTS["e2a_on_side_stream"]
    min_stages: int = DEFAULTS["min_stages"]
    #: What a decode graph captures (``True``/``False`` read as "1"/"0").
    graph: GraphMode = DEFAULTS["graph"]
    #: Whether a decode graph's overlap variant may capture the ``comm-side`` layout.
    graph_comm_side: bool = DEFAULTS["graph_comm_side"]
    backend: Backend = DEFAULTS["backend"]
    strict: bool = DEFAULTS["strict"]
    watchdog_s: float | None = DEFAULTS["watchdog_s"]
    group_timeout_s: float = DEFAULTS["group_timeout_s"]
    #: The device's vector cores where its properties give none (None: read from the device).
    vector_cores: int | None = DEFAULTS["vector_cores"]
    #: The vector cores one MoE collective kernel takes (None: every core of the device, the strictest reading).
    moe_cores: int | None = DEFAULTS["moe_cores"]
    adaptive: bool = DEFAULTS["adaptive"]
    reprobe_every: int = DEFAULTS["reprobe_every"]
    mode: Mode = DEFAULTS["mode"]
    #: The stream layouts of the ``overlap`` mode, in the order given (several:
    #: adaptive engage picks per shape bucket; the first is what decode graphs capture).
    layouts: tuple[LayoutName, ...] = DEFAULTS["layouts"]
    metrics_port: int | None = DEFAULTS["metrics_port"]
    metrics_addr: str = DEFAULTS["metrics_addr"]
    summary_s: float = DEFAULTS["summary_s"]
    #: Variables that were set, as read (for logs and ``doctor``).
    raw: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.graph, bool):
            object.__setattr__(self, "graph", "1" if self.graph else "0")

    @property
    def graph_overlap(self) -> bool:
        """Whether a capture may take an overlap variant (``GRAPH`` 1 or adaptive)."""
        return self.graph != "0"

    def with_overrides(self, **changes: object) -> OverlapConfig:
        """A copy with the given fields changed (used by tests and the bench);
        :class:`ConfigError` naming every field outside its range (``layouts``
        must be a tuple)."""
        cfg = replace(self, **changes)  # type: ignore[arg-type]
        _check_ranges(cfg)
        return cfg


def _check_ranges(cfg: OverlapConfig) -> None:
    problems: list[str] = []
    for var in TABLE:
        try:
            var.check(getattr(cfg, var.field))
        except BadValue as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(problems)


def load_config(env: Mapping[str, str] | None = None) -> OverlapConfig:
    """Parse the environment (``os.environ`` by default) into a config;
    :class:`ConfigError` naming every malformed or out-of-range variable
    (one problem each, in the table's order)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    problems: list[str] = []
    for var in TABLE:
        try:
            values[var.field] = value = var.read(env)
            var.check(value)
        except BadValue as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    return OverlapConfig(**values, raw={k: env[k] for k in ENV_VARS if k in env})  # each value checked above


def strict_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether strict mode is asked for, tolerating a malformed switch elsewhere
    (whether a :class:`ConfigError` itself should raise)."""
    env = os.environ if env is None else env
    try:
        return bool(BY_NAME[ENV_STRICT].read(env))
    except BadValue:
        return False
