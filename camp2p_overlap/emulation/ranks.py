"""A multi-rank emulated CAMP2P world: A attention ranks and F FFN ranks,
each its own process, over ``torch.distributed`` gloo on loopback only.

* The FFN processes init their own default world of the F FFN ranks (the
  FFN server's world: it stands for the EP group that carries the MoE's
  collectives); the attention processes init theirs of the A attention
  ranks (their TP group). The AFD point-to-point groups spanning both are
  built without a default group: ``ProcessGroupGloo`` over a ``PrefixStore``
  of one ``TCPStore`` hosted by attention rank 0 (one group per stage per
  FFN rank, as CAMP2P has one HCCL group per stage, plus one control group
  per FFN rank for the step's schedule).
* Mapping as CAMP2P's topology: ``many-to-one`` (A = k*F; attention rank a
  talks to FFN rank a // k, whose A2E gathers its k peers' tokens in peer
  order and whose E2A returns each its slice) or ``equal`` (A == F).
* Attention: per step every rank sends its FFN the schedule (stage ids, its
  token counts), then one thread per stage, per layer: A2E, E2A, a TP
  all-reduce among the attention ranks on that stage's own attention group,
  and the next layer's hidden states computed from the all-reduced result.
* FFN: patched through the real entry point (as ``gloo.ffn_main``); per
  (layer, stage) its compute issues a gloo all-to-all on the FFN default
  group as an emulated-device kernel of the stream the FFN runs on (MC2's
  dispatch and combine), whose result feeds the output.
* Two phases in the same processes: ``overlap`` (patched) and ``serial``
  (after ``camp2p_overlap.unpatch()``); every attention rank compares what it
  received in both bitwise.

The processes are in :mod:`camp2p_overlap.emulation.ranks_roles`; this module
holds the spec, the step plan, the launcher and the CLI:

    python -m camp2p_overlap.emulation.ranks --attn-ranks 4 --ffn-ranks 2 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MAPPINGS = ("many-to-one", "equal")
LAYOUTS = ("compute-side", "comm-side")
TIMINGS = ("wall", "model")
GRAPH_MODES = ("1", "adaptive")
MAX_STAGES = 3
#: Stage ids per step, cycling; mostly multi-stage steps (the overlap's), one
#: one-stage step per cycle (the serial gate's).
STAGE_CYCLES: dict[int, tuple[tuple[int, ...], ...]] = {
    2: ((0, 1), (0, 1), (1,), (0, 1)),
    3: ((0, 1, 2), (0, 1), (0, 1, 2), (2,), (1, 2)),
}
#: Plan entry kinds: an eager step (a replay when its key is captured), a
#: graph warm-up (eager), a graph capture (no data exchanged).
STEP, WARMUP, CAPTURE = "step", "warmup", "capture"
#: What a faulty FFN rank does (``RanksSpec.fault``).
FAULTS = ("exit", "stop")


@dataclass(frozen=True)
class RanksSpec:
    attn_ranks: int = 2
    ffn_ranks: int = 1
    mapping: str = "many-to-one"
    layers: int = 3
    steps: int = 6
    hidden: int = 16
    #: Most tokens per (attention rank, stage) of a step (drawn in 1..tokens).
    tokens: int = 6
    #: Attention ranks send different token counts (else every rank the same).
    vary_tokens: bool = False
    stages: int = 2
    seed: int = 0
    #: Every gloo group's timeout (an op that waits longer raises).
    timeout_s: float = 60.0
    #: The FFN runner built with ``use_aclgraph`` (the emulated device as
    #: ``torch.npu``); the first ``graph_keys`` schedules of the cycle are
    #: warmed up and captured before their first step, then replayed.
    graphs: bool = False
    graph_mode: str = "1"
    graph_keys: int = 2
    layout: str = "compute-side"
    adaptive: bool = False
    reprobe_every: int | None = None
    #: ``"model"``: the FFN kernel, the comm kernels and the MoE collective
    #: take modelled durations (the device's ``launch(model_s=)``/``hold_until``).
    timing: str = "wall"
    ffn_model_s: float = 2e-3
    link_model_s: float = 2e-4
    coll_model_s: float = 2e-4
    #: FFN rank -> FFN slowdown factor (a straggler, e.g. 1.3).
    straggler: dict[int, float] = field(default_factory=dict)
    #: FFN rank -> most seconds each of its FFN kernels takes more, at random (seeded per rank): its own noise.
    noise_s: dict[int, float] = field(default_factory=dict)
    #: FFN rank -> extra environment of that process.
    extra_env: dict[int, dict[str, str]] = field(default_factory=dict)
    #: FFN rank -> its MoE weights' seed (default: ``seed``; to show that
    #: every attention rank's outputs depend on every FFN rank).
    ffn_seed: dict[int, int] = field(default_factory=dict)
    #: FFN rank -> (fault, step): inside its first FFN kernel of that step the process exits (``"exit"``, as a
    #: crashed rank) or stops whole, its heartbeat too (``"stop"``, SIGSTOP, as a hung host); the launcher kills it.
    fault: dict[int, tuple[str, int]] = field(default_factory=dict)
    #: Each FFN rank's emulated device gets this many vector cores (None: no core model, nothing waits for cores).
    vector_cores: int | None = None
    #: Whether the device reports them (``get_device_properties().vector_core_num``); False hides them from the
    #: layer, whose core budget rule then has nothing to fit: a deployment with the rule off.
    report_cores: bool = True
    #: What the kernels take: CAM's A2E/E2A (``aiv_num``, resident), the MoE collective (MC2's dispatch/combine,
    #: resident), the experts (in waves). The MoE's count is also the layer's ``VLLM_CAMP2P_MULTISTREAM_MOE_CORES``.
    cam_cores: int = 8
    moe_cores: int = 8
    ffn_cores: int = 8
    #: FFN rank -> seconds its A2E's modelled link takes more (a rank whose attention peers are farther away).
    link_extra_s: dict[int, float] = field(default_factory=dict)
    #: The one stage whose A2E takes ``link_extra_s`` (None: every stage's).
    link_extra_stage: int | None = None
    #: FFN rank -> modelled seconds of its MoE gate (the router's matmul, on cube cores: it takes no vector cores)
    #: before MC2's dispatch, with a core model.
    gate_s: dict[int, float] = field(default_factory=dict)
    #: With a core model, the MoE block opens with MC2's dispatch (a second collective) as well as its combine.
    moe_dispatch: bool = True
    #: Which waiting kernel free cores go to first (``cores.HAND_OUT_ORDERS``).
    core_order: str = "oldest"

    def __post_init__(self) -> None:
        if self.mapping not in MAPPINGS:
            raise ValueError(f"mapping {self.mapping!r} is not one of {', '.join(MAPPINGS)}")
        listed = self.layout.split(",")
        if not listed or any(name not in LAYOUTS for name in listed) or len(set(listed)) != len(listed):
            raise ValueError(f"layout {self.layout!r} is not one or a comma list of {', '.join(LAYOUTS)}")
        if self.timing not in TIMINGS:
            raise ValueError(f"timing {self.timing!r} is not one of {', '.join(TIMINGS)}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode {self.graph_mode!r} is not one of {', '.join(GRAPH_MODES)}")
        if any(kind not in FAULTS for kind, _ in self.fault.values()):
            raise ValueError(f"a fault is one of {', '.join(FAULTS)}")
        if self.stages not in STAGE_CYCLES:
            raise ValueError(f"stages must be one of {sorted(STAGE_CYCLES)}")
        if any(n < 1 for n in (self.cam_cores, self.moe_cores, self.ffn_cores)) or (
            self.vector_cores is not None and self.vector_cores < 1
        ):
            raise ValueError("core counts are positive")
        if self.attn_ranks < 2 or self.ffn_ranks < 1:
            raise ValueError("a world needs at least 2 attention ranks and 1 FFN rank")
        if self.mapping == "equal" and self.attn_ranks != self.ffn_ranks:
            raise ValueError("mapping 'equal' needs as many attention ranks as FFN ranks")
        if self.mapping == "many-to-one" and self.attn_ranks % self.ffn_ranks:
            raise ValueError("mapping 'many-to-one' needs attention ranks a multiple of the FFN ranks")

    # -- topology --------------------------------------------------------
    @property
    def peers_per_ffn(self) -> int:
        return self.attn_ranks // self.ffn_ranks

    def ffn_of(self, attn_rank: int) -> int:
        """The FFN rank attention rank ``attn_rank`` talks to."""
        return attn_rank // self.peers_per_ffn

    def peers_of(self, ffn_rank: int) -> list[int]:
        """The attention ranks of FFN rank ``ffn_rank``, in peer order."""
        k = self.peers_per_ffn
        return list(range(ffn_rank * k, (ffn_rank + 1) * k))

    # -- schedule --------------------------------------------------------
    def stage_ids(self, step: int) -> tuple[int, ...]:
        cycle = STAGE_CYCLES[self.stages]
        return cycle[step % len(cycle)]

    def schedule(self, step: int, attn_rank: int) -> dict[int, int]:
        """Stage id -> token count attention rank ``attn_rank`` sends in
        ``step`` (repeating with the stage cycle, so graph keys recur)."""
        pos = step % len(STAGE_CYCLES[self.stages])
        who = attn_rank if self.vary_tokens else 0
        g = torch.Generator().manual_seed(self.seed * 100_003 + pos * 101 + who)
        return {s: int(torch.randint(1, self.tokens + 1, (1,), generator=g)) for s in self.stage_ids(step)}

    def plan(self) -> list[tuple[str, int]]:
        """The run's entries in order, (kind, step): with graphs, the first
        ``graph_keys`` steps are each preceded by a warm-up and a capture."""
        out: list[tuple[str, int]] = []
        for step in range(self.steps):
            if self.graphs and step < self.graph_keys:
                out += [(WARMUP, step), (CAPTURE, step)]
            out.append((STEP, step))
        return out

    # -- environment -----------------------------------------------------
    def ffn_env(self, ffn_rank: int) -> dict[str, str]:
        env = {
            "VLLM_CAMP2P_MULTISTREAM": "1",
            "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu",
            "VLLM_PLUGINS": "camp2p_overlap",
            "VLLM_CAMP2P_MULTISTREAM_LAYOUT": self.layout,
            "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE": "1" if self.adaptive else "0",
            "VLLM_CAMP2P_MULTISTREAM_GRAPH": self.graph_mode if self.graphs else "0",
        }
        if self.reprobe_every is not None:
            env["VLLM_CAMP2P_MULTISTREAM_REPROBE_EVERY"] = str(self.reprobe_every)
        if self.vector_cores is not None:
            env["VLLM_CAMP2P_MULTISTREAM_MOE_CORES"] = str(self.moe_cores)
        env.update(self.extra_env.get(ffn_rank, {}))
        return env

    # -- (de)serialization for the child processes -----------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RanksSpec:
        kw = json.loads(text)
        for name in ("straggler", "noise_s", "extra_env", "ffn_seed", "fault", "link_extra_s", "gate_s"):
            kw[name] = {int(k): v for k, v in kw.get(name, {}).items()}
        kw["fault"] = {k: (str(v[0]), int(v[1])) for k, v in kw["fault"].items()}
        return cls(**kw)


@dataclass(frozen=True)
class Ports:
    attn: int
    ffn: int
    store: int


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


# ---------------------------------------------------------------------------
# launcher
@dataclass
class WorldResult:
    spec: RanksSpec
    #: Attention rank -> its JSON (None: it wrote none).
    attention: dict[int, dict[str, Any] | None]
    #: FFN rank -> its JSON (None: it wrote none).
    ffn: dict[int, dict[str, Any] | None]
    #: Process name (``attn0``, ``ffn1``) -> return code (None: never ended).
    returncodes: dict[str, int | None]
    logs: dict[str, str]
    timed_out: bool
    seconds: float = 0.0

    @property
    def equal(self) -> dict[int, bool | None]:
        """Attention rank -> received bitwise the same in both phases."""
        return {a: (None if j is None else bool(j["equal"])) for a, j in self.attention.items()}

    def paths(self, phase: str = "overlap") -> dict[int, list[str]]:
        """FFN rank -> the path each entry of the plan took in ``phase``."""
        return {f: [s["path"] for s in j["steps"] if s["phase"] == phase] for f, j in self.ffn.items() if j}

    def step_s(self, phase: str = "overlap") -> dict[int, list[float]]:
        """FFN rank -> each entry's wall time (s) on that rank in ``phase``."""
        return {f: [s["seconds"] for s in j["steps"] if s["phase"] == phase] for f, j in self.ffn.items() if j}

    @property
    def ok(self) -> bool:
        return (
            not self.timed_out
            and all(rc == 0 for rc in self.returncodes.values())
            and all(v is True for v in self.equal.values())
        )

    def diagnostics(self, tail: int = 2500) -> str:
        return "".join(
            f"\n--- {name} (rc {self.returncodes[name]}) ---\n{log[-tail:]}" for name, log in self.logs.items()
        )


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P") and k != "VLLM_PLUGINS"}
    env.update(
        {
            "GLOO_SOCKET_IFNAME": "lo",  # loopback only
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
    )
    return env


def _start(name: str, role: str, rank: int, env: dict[str, str], out: Path, ports: Ports) -> subprocess.Popen:
    log = open(out / f"{name}.log", "w")
    try:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "camp2p_overlap.emulation.ranks_roles",
                f"--role={role}",
                f"--rank={rank}",
                f"--spec={out / 'spec.json'}",
                f"--out={out}",
                f"--ports={ports.attn},{ports.ffn},{ports.store}",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()  # the child holds its own descriptor


def _wait_all(procs: dict[str, subprocess.Popen], deadline: float, grace_s: float) -> bool:
    """Wait for every process until ``deadline``; once one failed, give the
    rest ``grace_s`` more. Returns whether any was still running at the end."""
    failed_at: float | None = None
    while True:
        alive = [p for p in procs.values() if p.poll() is None]
        if not alive:
            return False
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs.values()):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now >= deadline or (failed_at is not None and now - failed_at >= grace_s):
            return True
        time.sleep(0.05)


def _kill(procs: dict[str, subprocess.Popen]) -> None:
    """End every process still running, each by its own pid."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
    for p in procs.values():
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def run_world(spec: RanksSpec, out_dir: Path, *, timeout_s: float | None = None, grace_s: float = 10.0) -> WorldResult:
    """Start the A attention and F FFN processes on free loopback ports; wait
    at most ``timeout_s`` (default: twice the spec's op timeout plus 60 s);
    kill every process still running then (or ``grace_s`` after one failed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(spec.to_json())
    for old in out.glob("*.json"):
        if old.name != "spec.json":
            old.unlink()
    ports = Ports(*free_ports(3))
    base = _base_env()
    limit = timeout_s if timeout_s is not None else 2 * spec.timeout_s + 60.0
    procs: dict[str, subprocess.Popen] = {}
    t0 = time.monotonic()
    timed_out = False
    try:
        for a in range(spec.attn_ranks):
            procs[f"attn{a}"] = _start(f"attn{a}", "attention", a, base, out, ports)
        for f in range(spec.ffn_ranks):
            procs[f"ffn{f}"] = _start(f"ffn{f}", "ffn", f, {**base, **spec.ffn_env(f)}, out, ports)
        timed_out = _wait_all(procs, t0 + limit, grace_s)
    finally:
        _kill(procs)
    seconds = time.monotonic() - t0

    def load(name: str) -> dict[str, Any] | None:
        f = out / f"{name}.json"
        return json.loads(f.read_text()) if f.exists() else None

    return WorldResult(
        spec=spec,
        attention={a: load(f"attn{a}") for a in range(spec.attn_ranks)},
        ffn={f: load(f"ffn{f}") for f in range(spec.ffn_ranks)},
        returncodes={n: p.returncode for n, p in procs.items()},
        logs={n: (out / f"{n}.log").read_text(errors="replace") for n in procs},
        timed_out=timed_out,
        seconds=round(seconds, 3),
    )


# ---------------------------------------------------------------------------
# CLI
def _rank_map(items: list[str], cast: type) -> dict[int, Any]:
    out = {}
    for item in items:
        rank, _, value = item.partition("=")
        out[int(rank)] = cast(value)
    return out


def parse_spec(argv: list[str] | None = None) -> tuple[RanksSpec, Path, float | None]:
    d = RanksSpec()
    ap = argparse.ArgumentParser(description="camp2p-overlap: A attention ranks and F FFN ranks over gloo")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--attn-ranks", type=int, default=d.attn_ranks)
    ap.add_argument("--ffn-ranks", type=int, default=d.ffn_ranks)
    ap.add_argument("--mapping", choices=MAPPINGS, default=d.mapping)
    for name in ("layers", "steps", "hidden", "tokens", "stages", "seed", "graph_keys"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    ap.add_argument("--vary-tokens", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=d.timeout_s)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--graph-mode", choices=GRAPH_MODES, default=d.graph_mode)
    ap.add_argument("--layout", default=d.layout, help=f"one of {', '.join(LAYOUTS)}, or a comma list of them")
    ap.add_argument("--adaptive", action="store_true")
    ap.add_argument("--reprobe-every", type=int, default=None)
    ap.add_argument("--timing", choices=TIMINGS, default=d.timing)
    for name in ("ffn_model_s", "link_model_s", "coll_model_s"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    ap.add_argument("--straggler", action="append", default=[], metavar="RANK=FACTOR")
    ap.add_argument("--noise-s", action="append", default=[], metavar="RANK=SECONDS")
    ap.add_argument("--env", action="append", default=[], metavar="RANK=NAME=VALUE")
    ap.add_argument("--ffn-seed", action="append", default=[], metavar="RANK=SEED")
    ap.add_argument("--world-timeout-s", type=float, default=None)
    a = ap.parse_args(argv)
    extra: dict[int, dict[str, str]] = {}
    for item in a.env:
        rank, _, kv = item.partition("=")
        name, _, value = kv.partition("=")
        extra.setdefault(int(rank), {})[name] = value
    spec = RanksSpec(
        attn_ranks=a.attn_ranks,
        ffn_ranks=a.ffn_ranks,
        mapping=a.mapping,
        layers=a.layers,
        steps=a.steps,
        hidden=a.hidden,
        tokens=a.tokens,
        vary_tokens=a.vary_tokens,
        stages=a.stages,
        seed=a.seed,
        timeout_s=a.timeout_s,
        graphs=a.graphs,
        graph_mode=a.graph_mode,
        graph_keys=a.graph_keys,
        layout=a.layout,
        adaptive=a.adaptive,
        reprobe_every=a.reprobe_every,
        timing=a.timing,
        ffn_model_s=a.ffn_model_s,
        link_model_s=a.link_model_s,
        coll_model_s=a.coll_model_s,
        straggler=_rank_map(a.straggler, float),
        noise_s=_rank_map(a.noise_s, float),
        extra_env=extra,
        ffn_seed=_rank_map(a.ffn_seed, int),
    )
    return spec, a.out, a.world_timeout_s


def main(argv: list[str] | None = None) -> int:
    spec, out, world_timeout = parse_spec(argv)
    res = run_world(spec, out, timeout_s=world_timeout)
    summary = {
        "equal": res.equal,
        "paths": res.paths(),
        "step_s": res.step_s(),
        "returncodes": res.returncodes,
        "timed_out": res.timed_out,
        "seconds": res.seconds,
    }
    print(json.dumps(summary, indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
