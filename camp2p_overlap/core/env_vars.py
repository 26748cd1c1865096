"""The table of every ``VLLM_CAMP2P_*`` environment variable: its name, parsing, default, range or choices, help and
the :class:`~camp2p_overlap.core.config.OverlapConfig` field it fills. Everything else is produced from :data:`TABLE`:
``load_config`` and the config's defaults, the names given to vLLM's environment registry (plugin.py), ``doctor``'s
switches, and (``tools/docgen.py``) the README's configuration table and the CLI help. Imports only the standard
library.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

ENV_SWITCH = "VLLM_CAMP2P_MULTISTREAM"
ENV_A2E = "VLLM_CAMP2P_MULTISTREAM_A2E"
ENV_E2A = "VLLM_CAMP2P_MULTISTREAM_E2A"
ENV_MIN_STAGES = "VLLM_CAMP2P_MULTISTREAM_MIN_STAGES"
ENV_GRAPH = "VLLM_CAMP2P_MULTISTREAM_GRAPH"
ENV_GRAPH_COMM_SIDE = "VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE"
ENV_BACKEND = "VLLM_CAMP2P_MULTISTREAM_BACKEND"
ENV_STRICT = "VLLM_CAMP2P_MULTISTREAM_STRICT"
ENV_WATCHDOG = "VLLM_CAMP2P_MULTISTREAM_WATCHDOG_S"
ENV_ADAPTIVE = "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE"
ENV_REPROBE = "VLLM_CAMP2P_MULTISTREAM_REPROBE_EVERY"
ENV_MODE = "VLLM_CAMP2P_MULTISTREAM_MODE"
ENV_LAYOUT = "VLLM_CAMP2P_MULTISTREAM_LAYOUT"
ENV_METRICS_PORT = "VLLM_CAMP2P_MULTISTREAM_METRICS_PORT"
ENV_METRICS_ADDR = "VLLM_CAMP2P_MULTISTREAM_METRICS_ADDR"
ENV_SUMMARY = "VLLM_CAMP2P_MULTISTREAM_SUMMARY_S"
ENV_GROUP_TIMEOUT = "VLLM_CAMP2P_MULTISTREAM_GROUP_TIMEOUT_S"
ENV_VECTOR_CORES = "VLLM_CAMP2P_MULTISTREAM_VECTOR_CORES"
ENV_MOE_CORES = "VLLM_CAMP2P_MULTISTREAM_MOE_CORES"

#: CAMP2P has one HCCL group per stage: afd, afd1, afd2.
MAX_STAGES = 3
#: Bounds of the re-probe interval (steps of one shape bucket).
MIN_REPROBE, MAX_REPROBE = 2, 1_000_000
#: Default seconds an FFN rank waits for the others at an exchange (docs/design.md, "Many FFN ranks").
DEFAULT_GROUP_TIMEOUT_S = 30.0
#: Default seconds after which an engaged step not finished logs a stall report: above any engaged step, below
#: vLLM's execute-model timeout (300 s) and HCCL's (1836 s); docs/design.md, "The watchdog's default".
DEFAULT_WATCHDOG_S = 60.0
#: Default seconds between the periodic one-line summaries.
DEFAULT_SUMMARY_S = 60.0
#: Where the opt-in metrics endpoint listens unless told: loopback only.
DEFAULT_METRICS_ADDR = "127.0.0.1"

#: The accepted spellings of a switch (any case, surrounding blanks ignored).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

#: How a variable's text becomes a value (``choice-list``: one choice or a
#: comma list of distinct choices, kept in order, as a tuple).
Kind = Literal["switch", "integer", "choice", "choice-list", "seconds", "address"]
#: One label of a host name (RFC 1123): letters, digits, inner hyphens.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_ADDRESS_RULE = "is not an IPv4 or IPv6 address or a host name (e.g. 127.0.0.1, 0.0.0.0, ::1, localhost)"


def is_address(text: str) -> bool:
    """Whether ``text`` is an IPv4 or IPv6 literal or a host name a socket can bind."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    labels = (text[:-1] if text.endswith(".") else text).split(".")
    return (
        len(text) <= 253
        and all(_HOST_LABEL.fullmatch(label) for label in labels)
        and not labels[-1].isdigit()  # a malformed IPv4 literal, not a host name
    )


class BadValue(ValueError):
    """A value the table does not accept; the message names the variable
    and the value (config raises it as ``ConfigError``)."""


@dataclass(frozen=True)
class EnvVar:
    """One row of the table."""

    name: str
    #: The ``OverlapConfig`` field the variable fills.
    field: str
    kind: Kind
    #: The value when the variable is unset or blank (None: the feature is off).
    default: Any
    #: What it does, for users (Markdown; the range and choices are added from the fields below).
    help: str
    #: ``choice``, ``choice-list``: the accepted values, in order, each with what it means ("" when the value says it).
    choices: tuple[tuple[str, str], ...] = ()
    #: ``integer``: inclusive bounds; ``seconds``: whether 0 is accepted (``low=0``) or not (None).
    low: int | None = None
    high: int | None = None
    #: ``integer``: what the value is, in a parse error ("an integer", "a TCP port number").
    noun: str = "an integer"
    #: Added to an out-of-range error.
    range_note: str = ""
    #: What 0 means, where it means something of its own ("" otherwise).
    zero: str = ""
    #: What unset means when the default is None.
    unset: str = ""
    #: ``choice``, ``seconds``: other spellings accepted for a value (word, value).
    aliases: tuple[tuple[str, str], ...] = ()
    #: ``choice-list``: what a comma list of several values means.
    listed: str = ""

    @property
    def values(self) -> tuple[str, ...]:
        """The accepted values of a ``choice`` or ``choice-list``, in order."""
        return tuple(v for v, _ in self.choices)

    def _list_rule(self) -> str:
        return f"(accepted: one of {', '.join(self.values)}, or a comma list of them, each at most once)"

    # -- parsing -----------------------------------------------------------
    def read(self, env: Mapping[str, str]) -> Any:
        """The value ``env`` gives this variable: its default when unset or
        blank. Raises :class:`BadValue` for a malformed value (the range
        of an integer is :meth:`check`'s)."""
        raw = env.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        return self.parse(raw)

    def parse(self, raw: str) -> Any:
        """``raw`` (set, not blank) as this variable's value; surrounding
        blanks are ignored, switches and choices read in any case."""
        text = raw.strip()
        if self.kind == "switch":
            word = text.lower()
            if word in TRUE_WORDS:
                return True
            if word in FALSE_WORDS:
                return False
            spellings = ", ".join(f"{t}/{f}" for t, f in zip(TRUE_WORDS, FALSE_WORDS, strict=True))
            raise BadValue(f"{self.name}={raw!r} is not a boolean; use one of {spellings}")
        if self.kind == "integer":
            try:
                return int(text, 10)
            except ValueError:
                raise BadValue(f"{self.name}={raw!r} is not {self.noun}") from None
        if self.kind == "choice":
            word = dict(self.aliases).get(text.lower(), text.lower())
            if word not in self.values:
                raise BadValue(f"{self.name}={raw!r} is not one of {', '.join(self.values)}")
            return word
        if self.kind == "choice-list":
            return self._parse_list(raw)
        if self.kind == "address":
            if not is_address(text):
                raise BadValue(f"{self.name}={raw!r} {_ADDRESS_RULE}")
            return text
        try:
            seconds = float(dict(self.aliases).get(text.lower(), text))
        except ValueError:
            raise BadValue(f"{self.name}={raw!r} is not a number of seconds") from None
        self._check_seconds(raw, seconds)
        return seconds

    def _parse_list(self, raw: str) -> tuple[str, ...]:
        """``raw`` as a tuple of distinct values, in the order given."""
        items: list[str] = []
        for item in raw.split(","):
            word = item.strip().lower()
            if not word:
                raise BadValue(f"{self.name}={raw!r} has an empty item {self._list_rule()}")
            if word not in self.values:
                raise BadValue(f"{self.name}={raw!r}: unknown value {item.strip()!r} {self._list_rule()}")
            if word in items:
                raise BadValue(f"{self.name}={raw!r} lists {word!r} twice {self._list_rule()}")
            items.append(word)
        return tuple(items)

    def check(self, value: Any) -> None:
        """Raise :class:`BadValue` when ``value`` is outside the range or
        choices (run on every configuration, also one built by overrides)."""
        if value is None and self.default is None:
            return
        if self.kind == "integer" and not self.low <= value <= self.high:  # type: ignore[operator]
            note = f" ({self.range_note})" if self.range_note else ""
            raise BadValue(f"{self.name}={value} is out of range {self.low}..{self.high}{note}")
        if self.kind == "choice" and value not in self.values:
            raise BadValue(f"{self.name}={value!r} is not one of {', '.join(self.values)}")
        if self.kind == "choice-list":
            self._check_list(value)
        if self.kind == "seconds":
            self._check_seconds(value, value)
        if self.kind == "address" and not (isinstance(value, str) and is_address(value)):
            raise BadValue(f"{self.name}={value!r} {_ADDRESS_RULE}")

    def _check_list(self, value: Any) -> None:
        if not isinstance(value, tuple):
            raise BadValue(f"{self.name}={value!r} is not a tuple of values {self._list_rule()}")
        if not value:
            raise BadValue(f"{self.name}={value!r} is empty {self._list_rule()}")
        for i, item in enumerate(value):
            if item not in self.values:
                raise BadValue(f"{self.name}={value!r}: unknown value {item!r} {self._list_rule()}")
            if item in value[:i]:
                raise BadValue(f"{self.name}={value!r} lists {item!r} twice {self._list_rule()}")

    def _check_seconds(self, shown: Any, seconds: float) -> None:
        if not (math.isfinite(seconds) and (seconds >= 0 if self.low == 0 else seconds > 0)):
            rule = "0 (off) or a positive" if self.low == 0 else "a positive"
            raise BadValue(f"{self.name}={shown!r} must be {rule}, finite number of seconds")

    # -- describing (Markdown; plain text for the CLI) ----------------------
    def default_text(self, markdown: bool = True) -> str:
        """The default as a user reads it: on/off, unset, a number or a choice."""
        d = self.default
        if d is None:
            text = "unset"
        elif self.kind == "choice-list":
            text = f"`{','.join(d)}`"
        elif isinstance(d, bool):
            text = "on" if d else "off"
        elif isinstance(d, float):
            text = f"{d:g}"
        else:
            text = f"`{d}`" if self.kind in ("choice", "address") else str(d)
        return text if markdown else plain(text)

    def accepted(self, markdown: bool = True) -> str:
        """The accepted values: the choices with their meanings, or the range."""
        if self.kind == "switch":
            text = "on/off"
        elif self.kind in ("choice", "choice-list"):
            text = ", ".join(f"`{v}`" + (f" ({m})" if m else "") for v, m in self.choices)
            if self.kind == "choice-list":
                text += f"; or a comma list of them, each once (`{','.join(self.values)}`)"
        elif self.kind == "integer":
            text = f"{self.noun.split(' ', 1)[1]}, {self.low}–{self.high}"
        elif self.kind == "address":
            text = "IP or host name"
        else:
            text = "seconds, ≥ 0" if self.low == 0 else "seconds, > 0"
        return text if markdown else plain(text)

    def meaning(self, markdown: bool = True) -> str:
        """The whole help: what it does, then the accepted values and what
        unset and 0 mean."""
        if self.kind in ("choice", "choice-list"):
            text = f"{self.help}: {self.accepted()}" + (f": {self.listed}" if self.listed else "")
        else:
            notes = [] if self.kind == "switch" else [self.accepted()]
            notes += [f"unset: {self.unset}"] if self.unset else []
            zero = " or ".join(["`0`", *(f"`{word}`" for word, value in self.aliases if value == "0")])
            notes += [f"{zero}: {self.zero}"] if self.zero else []
            text = f"{self.help} ({'; '.join(notes)})" if notes else self.help
        return text if markdown else plain(text)


_PLAIN = {"`": "", "–": "..", "≥": ">=", "→": "->"}


def plain(text: str) -> str:
    """``text`` without Markdown code marks, in ASCII punctuation (for a terminal)."""
    for mark, ascii_text in _PLAIN.items():
        text = text.replace(mark, ascii_text)
    return text


#: Every variable the package reads, in the order of the ``OverlapConfig`` fields.
TABLE: tuple[EnvVar, ...] = (
    EnvVar(
        ENV_SWITCH,
        "enabled",
        "switch",
        False,
        "master switch: while it is off, `apply()` (the vLLM plugin runs it in each process) patches nothing",
    ),
    EnvVar(
        ENV_A2E,
        "a2e_on_side_stream",
        "switch",
        True,
        "`comm-side` layout only: A2E (the receive from attention) on the per-stage side streams (off: on C)",
    ),
    EnvVar(
        ENV_E2A,
        "e2a_on_side_stream",
        "switch",
        True,
        "`comm-side` layout only: E2A (the send to attention) on the per-stage side streams (off: on C)",
    ),
    EnvVar(
        ENV_MIN_STAGES,
        "min_stages",
        "integer",
        2,
        "fewest micro-batch stages in a step for the overlap to engage",
        low=1,
        high=MAX_STAGES,
        range_note=f"CAMP2P has {MAX_STAGES} stage groups",
    ),
    EnvVar(
        ENV_GRAPH,
        "graph",
        "choice",
        "0",
        "what a decode graph captures per key",
        choices=(
            ("0", "the serial step, upstream's graph"),
            ("1", "the overlap"),
            ("adaptive", "both; each replay runs its key's choice"),
        ),
        aliases=(("off", "0"), ("false", "0"), ("no", "0"), ("on", "1"), ("true", "1"), ("yes", "1")),
    ),
    EnvVar(
        ENV_GRAPH_COMM_SIDE,
        "graph_comm_side",
        "switch",
        False,
        "opt-in: a decode graph's overlap variant may capture `comm-side` (HCCL on side streams in a graph, which"
        ' upstream avoids: docs/design.md "Decode graphs")',
    ),
    EnvVar(
        ENV_BACKEND,
        "backend",
        "choice",
        "auto",
        "stream backend",
        choices=(
            ("auto", "from the runner's device: `npu` or `cuda`"),
            ("npu", ""),
            ("cuda", ""),
            ("cpu", "worker-thread streams, for emulation and tests only; never chosen by `auto`"),
        ),
    ),
    EnvVar(
        ENV_STRICT,
        "strict",
        "switch",
        False,
        "raise instead of logging when a value is malformed or the layer refuses: `apply()`, and so vLLM, fails",
    ),
    EnvVar(
        ENV_WATCHDOG,
        "watchdog_s",
        "seconds",
        DEFAULT_WATCHDOG_S,
        "log a stall report (ops issued, events completed, the likely missing peer op, the cores) when an"
        " engaged step or a decode graph replay runs longer than this",
        low=0,
        zero="no watchdog",
        aliases=(("off", "0"),),
    ),
    EnvVar(
        ENV_GROUP_TIMEOUT,
        "group_timeout_s",
        "seconds",
        DEFAULT_GROUP_TIMEOUT_S,
        "with several FFN ranks: how long a rank waits for the others at an exchange before every step runs"
        " upstream's path",
    ),
    EnvVar(
        ENV_VECTOR_CORES,
        "vector_cores",
        "integer",
        None,
        "the device's vector core count where its properties give none (the core budget rule)",
        low=1,
        high=4096,
        noun="a core count",
        unset="`vector_core_num`",
    ),
    EnvVar(
        ENV_MOE_CORES,
        "moe_cores",
        "integer",
        None,
        "vector cores one MoE collective (MC2) kernel takes, its profiler `Block Dim`: a layout engages only where"
        " its CAM kernels and this fit",
        low=1,
        high=4096,
        noun="a core count",
        unset="the whole device",
    ),
    EnvVar(
        ENV_ADAPTIVE,
        "adaptive",
        "switch",
        True,
        "adaptive engage: per runner and step shape, measure overlapped and serial steps and engage only where"
        " the overlap is faster (off: engage on every step the gate allows)",
    ),
    EnvVar(
        ENV_REPROBE,
        "reprobe_every",
        "integer",
        64,
        "with adaptive engage, every this many steps of a shape (or graph key) run a probe round of the path"
        " not chosen: 3 probes faster by 5 % switch it; a round slower by 10 % doubles the interval, up to"
        " 8 times; a close first decision (within 10 %) is probed within 16 steps, where 1 % faster switches it",
        low=MIN_REPROBE,
        high=MAX_REPROBE,
    ),
    EnvVar(
        ENV_MODE,
        "mode",
        "choice",
        "overlap",
        "rollout mode, a rung of the ladder `parity` → `reorder` → `overlap`",
        choices=(
            ("overlap", f"the layout(s) of `{ENV_LAYOUT}`"),
            ("reorder", "the overlap's order, every op on the compute stream"),
            ("parity", "the layer engaged, upstream's order on the compute stream"),
        ),
    ),
    EnvVar(
        ENV_LAYOUT,
        "layouts",
        "choice-list",
        ("compute-side",),
        "stream layout of the `overlap` mode",
        choices=(
            (
                "compute-side",
                "A2E/E2A on the caller's stream in the overlap's order, the FFN on a side stream: the default",
            ),
            (
                "comm-side",
                "each stage's A2E/E2A on a side stream per HCCL group, the FFN on the caller's stream: opt-in",
            ),
        ),
        listed="adaptive engage measures each per shape bucket and runs the fastest; decode graphs capture the first",
    ),
    EnvVar(
        ENV_METRICS_PORT,
        "metrics_port",
        "integer",
        None,
        "opt-in: this worker's step metrics on `http://<addr>:<port>/metrics`",
        low=0,
        high=65535,
        noun="a TCP port number",
        unset="off",
        zero="any free port, logged",
    ),
    EnvVar(
        ENV_METRICS_ADDR,
        "metrics_addr",
        "address",
        DEFAULT_METRICS_ADDR,
        "listen address; `0.0.0.0` to scrape from other hosts",
    ),
    EnvVar(
        ENV_SUMMARY,
        "summary_s",
        "seconds",
        DEFAULT_SUMMARY_S,
        "seconds between one-line step summaries in the log, if counts changed",
        low=0,
        zero="none",
    ),
)

#: By name.
BY_NAME: dict[str, EnvVar] = {v.name: v for v in TABLE}
#: ``OverlapConfig`` field -> its default.
DEFAULTS: dict[str, Any] = {v.field: v.default for v in TABLE}
