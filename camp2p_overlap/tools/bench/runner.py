"""The benchmark: serial vs upstream's E2A-only design vs this package's
overlap in each of its layouts (:data:`POLICIES`: ``compute-side``, the
users' default, and ``comm-side``, each adaptive and fixed, and both
listed), on the emulated CAMP2P FFN rank, through the very patch engine and
wrappers users get.

Per repetition, for each policy in turn (policies interleaved in one
process): apply the engine with the policy's configuration (``serial``: the
engine stays unpatched, i.e. upstream's code as it is today), run warm-up
steps and the timed steps, then traced steps, then unpatch. ``serial`` traces
every timed step id again with the engine applied but both directions
switched off: the wrappers' pass-through path, i.e. upstream's loop with each
A2E, FFN and E2A recorded on the compute stream. The other policies trace one
step (for ``--trace``/``--plot`` and the edge checker).

* per-layer time: a step's wall time / the step's number of FFN layers;
  median and p90 over every timed step of every repetition;
* speedup: median(serial) / median(policy);
* f, a_s, e_s: medians over the serial traced steps (FFN per (layer, stage);
  A2E per stage without the time it waited for its attention peer; E2A per
  stage);
* floor per layer: max(S * f, max over stages of a_s + f + e_s + attn). The
  first term is the compute stream's work; the second is one stage group's
  dependency cycle per layer (A2E, its FFN, E2A, then the attention peer
  before the next A2E can arrive), which no schedule can shorten;
* fill/drain floor per layer (:func:`_fill_drain_terms`): max((a_first +
  L * S * f + e_last) / L, max over stages of (L * (a_s + f + e_s) + (L - 1)
  * attn) / L): also the step's first A2E (the first stage's, before any
  FFN can start) and last E2A (the last stage's, after the last FFN), which
  no layout can hide; a stage's chain without the attention after the
  step's last E2A;
* eta = (T_serial - T_policy) / (T_serial - T_floor): the share of the
  hideable time a policy hid (1.0 = all of it); not given when the hideable
  time is under ETA_MIN_HIDEABLE of T_serial (one stage, say), where the
  ratio would only measure noise; ``eta_fill_drain`` the same against the
  fill/drain floor;
* outputs: every timed and traced step of every policy is compared bitwise
  (``torch.equal``) with the serial run of the same step id (the emulated
  attention inputs depend on the step id, which is set before each step).

``graph`` (``--graph``; ``--device cuda``: CUDA graphs, ``--device cpu``: the
emulated device's): upstream's decode graph path, every capture in the
runner's one graph pool. Each fixed policy's step is captured once per graph
key, with its patch layer's config applied (``graph=True``; serial: unpatched), after
the eager warm-up steps that create the side streams (run apart from the
capture step, whose wall time and device memory are measured alone: the
report's ``capture``, ``graph_pool``), and the patch layer is unpatched after: a
replay runs only the captured kernels, so such a graph replays after its
patch layer was unpatched (on streams of the graph's own). Adaptive ``overlap`` is
captured last with both variants (``graph="adaptive"``: upstream's serial
graph and the patch layer's overlap graph behind one ``VariantGraph``), and its
patch layer stays applied until every replay has run: its graph picks the variant
per replay through the patch layer's runtime (learning, hysteresis, re-probes).
Then, per repetition, the captured graphs are replayed round-robin, one
replay per policy per step id in a rotating order, each timed as an eager
step is (``run_step`` + synchronize) and compared bitwise with the eager
serial step of the same step id. Serial's pass-through traced steps (eager)
give f, a, e and the floor as above; they need serial's own engine applied,
so with adaptive ``overlap`` in the run they follow the last repetition's
replays (once its patch layer is unpatched) instead of each repetition's.
Speedup, eta and their intervals are the eager run's (:func:`_report`), over
replays: speedup against serial's graph.

Worlds: ``--device cpu`` runs the host world (``emulation/world.py``: the
transport and the attention peers on the host); ``--device cuda|npu``, and
``--device cpu --device-world``, the device world
(``emulation/kernel_world.py``: static attention buffers filled before each
step or replay, results read from static buffers after it, the peer on the
device), which is capturable: on the CPU it runs on the emulated device,
which enforces the capture rules.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from types import SimpleNamespace
from typing import Any

import torch

import camp2p_overlap
from camp2p_overlap.core.config import OverlapConfig
from camp2p_overlap.core.env_vars import MAX_STAGES
from camp2p_overlap.core.keys import COMPUTE_STREAM, FFN_STREAM, side_stream_name
from camp2p_overlap.core.observe.trace import ExpectedSchedule, TraceOp, TraceRecorder, recording
from camp2p_overlap.core.overlap.graphs import VariantGraph
from camp2p_overlap.core.overlap.plan import A2E_ONLY, COMM_SIDE, COMPUTE_SIDE, E2A_ONLY, Layout, layouts_of
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation.device import TimingCounts
from camp2p_overlap.emulation.ffn_timing import fixed as fixed_ffn
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.standin_patch_layer import emulated_patch_layer, release_site, standin_site
from camp2p_overlap.emulation.world import LinkModel, WorldSpec, build_world
from camp2p_overlap.tools.bench.calibrate import in_run_schedules, refine_ffn_in_run
from camp2p_overlap.tools.bench.launch import launch_sample, launch_summary, launch_verdict
from camp2p_overlap.tools.bench.timing import timing_mode, timing_noise, timing_problems, timing_report
from camp2p_overlap.tools.provenance import report_env
from camp2p_overlap.verify.edges import check_step
from camp2p_overlap.verify.peer_cycle import check_peer_cycle

SCHEMA = "camp2p-overlap/bench/v1"
#: Slack of the peer-cycle check (clock and timing-event granularity), ns.
PEER_TOLERANCE_NS = 5_000
#: The most cores one emulated comm op may hold: CPU threads, device SMs
#: (the device kernel also checks the GPU's own SM count).
MAX_COMM_CORES = {"cpu": 64, "cuda": 1024, "npu": 1024}
PROFILE_NEEDS_DEVICE = (
    "--profile-trace needs --device cuda or npu (device kernels come from the device profiler); "
    "on the CPU backend the edge checker already reads what the streams performed (--trace)"
)
#: eta is reported only when T_serial - T_floor is at least this share of T_serial.
ETA_MIN_HIDEABLE = 0.05
#: ``sys.setswitchinterval`` of the emulation tools' processes (bench, sweep,
#: overhead, scripts/soak.py; never the patch layer's): the emulated streams,
#: the compute stream included, are Python threads, and at CPython's default
#: of 5 ms a thread that could run waits up to that long for the GIL, which
#: at small work per (layer, stage) would swamp what is measured.
TOOL_SWITCH_INTERVAL_S = 0.0002
GRAPH_NOT_ON_NPU = (
    "--graph runs on --device cuda (CUDA graphs) and --device cpu (the emulated device) only: the device "
    "world's capture path has not been run on an NPU (torch_npu's ACL graphs, their stream budget)"
)
#: Why a policy is left out of a run (:func:`policy_skips`).
GRAPH_COMM_ON_THE_EMULATED_NPU = (
    "its layout puts CAM comm (A2E/E2A) on side streams, which the emulated device refuses to capture while it "
    "stands in for torch.npu, as upstream's NPU graph code keeps HCCL/CAM comm on the capture's stream "
    '(--device cuda captures it, with graph_comm_side; docs/benchmark.md, "Graph mode")'
)
GRAPH_ONE_ADAPTIVE = (
    "only one adaptive policy's patch layer can stay applied while the replays run (its graph chooses a variant "
    "per replay through it); this run's is {held}"
)
COUPLED_COMPUTE_SIDE = (
    "with coupled attention (--attention coupled: the peer sends a stage's A2E of layer L+1 only once every "
    "stage's E2A of layer L has arrived) compute-side stalls: it issues A2E(L+1, s) on the caller's stream right "
    "after E2A(L, s), ahead of E2A(L, s') of the other stages, and waits there until the op timeout; not run"
)


@dataclass(frozen=True)
class Policy:
    """One policy of the benchmark: the config its patch layer is applied with."""

    name: str
    #: The layouts its config lists (VLLM_CAMP2P_MULTISTREAM_LAYOUT), in order; None: the engine stays unpatched.
    layouts: tuple[str, ...] | None
    #: Adaptive engage on: the steps take the path (a listed layout, or serial) measured fastest per bucket.
    adaptive: bool = False
    #: ``comm-side``'s direction switches (A2E, E2A on the per-stage side streams); e2a-only: (False, True).
    a2e_side: bool = True
    e2a_side: bool = True
    help: str = ""

    def config(self, backend: str, *, graph: bool = False) -> OverlapConfig | None:
        """Its patch layer's config (None: unpatched). ``graph``: decode graphs capture its first listed layout,
        both variants (``"adaptive"``) for an adaptive policy; a layout with comm on side streams is captured
        with ``graph_comm_side`` (VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1), which upstream's NPU graph code
        needs opted in."""
        if self.layouts is None:
            return None
        cfg = OverlapConfig(
            enabled=True,
            backend=backend,  # type: ignore[arg-type]
            layouts=self.layouts,  # type: ignore[arg-type]
            a2e_on_side_stream=self.a2e_side,
            e2a_on_side_stream=self.e2a_side,
            adaptive=self.adaptive,
            graph=("adaptive" if self.adaptive else "1") if graph else "0",
        )
        if graph and self.comm_on_side():
            cfg = replace(cfg, graph_comm_side=True)
        return cfg

    def layout_objects(self) -> tuple[Layout, ...]:
        """The layouts its steps may run (``plan.layouts_of`` of its config); empty: unpatched."""
        cfg = self.config("cpu")
        return () if cfg is None else layouts_of(cfg)

    def layout_names(self) -> tuple[str, ...]:
        return tuple(layout.name for layout in self.layout_objects())

    def comm_on_side(self) -> bool:
        """Whether its first listed layout (what a decode graph captures) puts A2E or E2A on side streams."""
        first = self.layout_objects()[:1]
        return bool(first) and first[0].comm_on_side

    def streams(self) -> tuple[str, str, str]:
        """Where its first listed layout runs A2E, E2A and the FFN: C, K_s or F."""
        first = self.layout_objects()[:1]
        if not first:
            return (COMPUTE_STREAM, COMPUTE_STREAM, COMPUTE_STREAM)
        lay = first[0]
        return (
            "K_s" if lay.a2e_side else COMPUTE_STREAM,
            "K_s" if lay.e2a_side else COMPUTE_STREAM,
            FFN_STREAM if lay.ffn_side else COMPUTE_STREAM,
        )


#: Every policy, by name. ``overlap`` is what users get by default (the
#: compute-side layout, adaptive engage on); each layout also runs fixed
#: (adaptive engage off: engaged on every step the gate allows).
POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("serial", None, help="engine unpatched: upstream's loop, everything on the compute stream (today)"),
        Policy(
            "e2a-only",
            ("comm-side",),
            a2e_side=False,
            help="E2A on per-stage side streams K_s, A2E and the FFN on the compute stream (upstream PR #161's "
            "design; comm-side with A2E switched off)",
        ),
        Policy(
            "overlap",
            ("compute-side",),
            adaptive=True,
            help="this package as users get it: the compute-side layout (A2E/E2A on the caller's stream C in the "
            "overlap's order, the FFN on the runner's side stream F), engaged only where it measured faster than "
            "serial (adaptive engage on)",
        ),
        Policy(
            "compute-side-fixed",
            ("compute-side",),
            help="the compute-side layout engaged on every step the gate allows (adaptive engage off)",
        ),
        Policy(
            "comm-side",
            ("comm-side",),
            adaptive=True,
            help="the comm-side layout (A2E and E2A on per-stage side streams K_s with the receive lookahead, the "
            "FFN on C; VLLM_CAMP2P_MULTISTREAM_LAYOUT=comm-side), adaptive engage on",
        ),
        Policy(
            "comm-side-fixed",
            ("comm-side",),
            help="the comm-side layout engaged on every step the gate allows (adaptive engage off)",
        ),
        Policy(
            "both",
            ("compute-side", "comm-side"),
            adaptive=True,
            help="both layouts listed (VLLM_CAMP2P_MULTISTREAM_LAYOUT=compute-side,comm-side): adaptive engage "
            "measures each and serial per shape bucket and keeps the fastest",
        ),
    )
}
#: Names a policy had before, and what it is called now (a usage error says so).
RENAMED = {
    "overlap-fixed": "compute-side-fixed (the default layout fixed; the comm-side layout it ran before the "
    "layouts were named is comm-side-fixed)"
}
#: The default set: both layouts side by side (fixed), the users' default and upstream's design.
DEFAULT_POLICIES = ("serial", "e2a-only", "overlap", "compute-side-fixed", "comm-side-fixed")
#: Policies that run with adaptive engage on; every other policy engages whenever the gate allows.
ADAPTIVE_POLICIES = frozenset(name for name, p in POLICIES.items() if p.adaptive)
POLICY_HELP = {name: p.help for name, p in POLICIES.items()}
#: The adaptive policy's steady state against the better layout: the goal is within this share of it.
LAYOUT_TOLERANCE = 0.03
#: ``--attention``: the attention side's coupling of the stages.
ATTENTION_CHOICES = ("per-stage", "coupled")


def unknown_policies(names: Iterable[str]) -> str | None:
    """What is wrong with policy names (None: nothing), naming a renamed one's new name."""
    unknown = [p for p in names if p not in POLICIES]
    if not unknown:
        return None
    renamed = [f"{p} is now {RENAMED[p]}" for p in unknown if p in RENAMED]
    hint = f"; {', '.join(renamed)}" if renamed else ""
    return f"unknown policy {', '.join(unknown)} (choose from {', '.join(POLICIES)}{hint})"


#: Bootstrap resamples for the 95% intervals of speedup and eta.
BOOTSTRAP_RESAMPLES = 400
#: An interval wider than this either side of its estimate is reported as noisy.
NOISY_HALF_WIDTH = 0.1


@dataclass(frozen=True)
class BenchParams:
    """Every knob of one benchmark run (the command-line flags)."""

    device: str = "cpu"
    layers: int = 4
    stages: int = 2
    tokens: int = 128
    hidden: int = 512
    ffn: int = 1024
    experts: int = 8
    top_k: int = 2
    link_latency_us: float = 200.0
    link_gbps: float = 4.0
    attn_us: float = 200.0
    steps: int = 8
    warmup: int = 2
    reps: int = 3
    seed: int = 0
    threads: int = 1
    comm_cores: int = 0
    #: ``--comm-cores-sweep``: run the whole benchmark once per value of
    #: ``--comm-cores`` (the contention model off at 0, on above), every run
    #: on the same timing (wall-clock kernels when a value is above 0), and
    #: report them side by side (the report's ``contention``); empty: one run.
    comm_cores_sweep: tuple[int, ...] = ()
    policies: tuple[str, ...] = DEFAULT_POLICIES
    scenario: str | None = None
    #: ``--attention``: ``per-stage`` (each stage's next A2E waits for that
    #: stage's E2A alone, as vLLM's DBO micro-batching) or ``coupled`` (it
    #: waits for every stage's E2A of the layer: ``emulation/coupled.py``;
    #: the host world only; compute-side is not run, :data:`COUPLED_COMPUTE_SIDE`).
    attention: str = "per-stage"
    #: Capture each policy's step once (upstream's decode graph path; adaptive
    #: ``overlap`` with both variants) in one graph pool and time replays
    #: (cuda: CUDA graphs; cpu: the emulated device's).
    graph: bool = False
    #: ``--device cpu`` only: run the device world (static attention buffers,
    #: the device-side peer, ``emulation/kernel_world.py``) on the emulated
    #: device instead of the host world: the code path of ``--device cuda``, on
    #: the CPU. (cuda and npu always run the device world.)
    device_world: bool = False
    #: ``--timing``: ``model`` (kernels take modelled durations: the FFN's
    #: calibrated at the start of the run), ``wall`` (wall-clock kernels) or
    #: ``auto`` (model on the CPU's emulated device, wall with
    #: ``--comm-cores``; a device's own time on cuda/npu). tools/bench/timing.py.
    timing: str = "auto"
    #: ``--ffn-us``: the FFN kernel's modelled duration, given instead of
    #: calibrated (modelled timing only), so that runs compare exactly.
    ffn_us: float | None = None
    #: ``--comm-ratio``: with modelled timing, the link is set once the FFN's
    #: model is known so that A2E + E2A of one (layer, stage) take this share
    #: of it (:func:`link_for_ratio`; the ffn-bound preset: 0.5), in place of
    #: the link flags; None: the link flags as given.
    comm_ratio: float | None = None

    def timing_mode(self) -> tuple[str, str]:
        """``(model, why)`` of this run: ``model``, ``wall`` or ``device``."""
        return timing_mode(self.device, self.timing, self.most_comm_cores())

    def most_comm_cores(self) -> int:
        """The most cores a comm op keeps busy in any run of this benchmark (``--comm-cores-sweep`` included):
        above 0, every run takes wall-clock kernels (``tools/bench/timing.py``)."""
        return max((self.comm_cores, *self.comm_cores_sweep))

    def link(self) -> LinkModel:
        return LinkModel(latency_s=self.link_latency_us * 1e-6, bandwidth_Bps=self.link_gbps * 1e9 / 8)

    def world_spec(self) -> WorldSpec:
        return WorldSpec(
            layers=self.layers,
            stage_ids=tuple(range(self.stages)),
            tokens=self.tokens,
            shape=MoEShape(hidden=self.hidden, ffn=self.ffn, experts=self.experts, top_k=self.top_k),
            link=self.link(),
            attn_s=self.attn_us * 1e-6,
            op_timeout_s=60.0,
            seed=self.seed,
            device="cpu",
            comm_cores=self.comm_cores,
            graph=self.graph,
            timing="model" if self.timing_mode()[0] == "model" else "wall",
        )

    def validate(self) -> None:
        problems = []
        if self.device not in ("cpu", "cuda", "npu"):
            problems.append(f"--device {self.device!r} is not one of cpu, cuda, npu")
        if not 1 <= self.stages <= MAX_STAGES:
            problems.append(f"--stages {self.stages} is out of range 1..{MAX_STAGES} (CAMP2P has 3 stage groups)")
        for name in ("layers", "tokens", "hidden", "ffn", "experts", "top_k", "steps", "reps", "threads"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1")
        if self.top_k > self.experts:
            problems.append(f"--top-k {self.top_k} is larger than --experts {self.experts}")
        if self.warmup < 0:
            problems.append("--warmup must not be negative")
        most = MAX_COMM_CORES.get(self.device, 0)
        if not 0 <= self.comm_cores <= most:
            problems.append(f"--comm-cores {self.comm_cores} is out of range 0..{most} on {self.device}")
        bad = [n for n in self.comm_cores_sweep if not 0 <= n <= most]
        if bad:
            problems.append(f"--comm-cores-sweep {bad[0]} is out of range 0..{most} on {self.device}")
        if self.comm_cores_sweep and self.comm_cores:
            problems.append("give --comm-cores or --comm-cores-sweep, not both (the sweep sets each run's)")
        if len(set(self.comm_cores_sweep)) != len(self.comm_cores_sweep):
            problems.append("--comm-cores-sweep names a value twice")
        if self.attention not in ATTENTION_CHOICES:
            problems.append(f"--attention {self.attention!r} is not one of {', '.join(ATTENTION_CHOICES)}")
        elif self.attention == "coupled" and (self.device != "cpu" or self.device_world or self.graph):
            problems.append(
                "--attention coupled runs on the host world only (--device cpu, eager: no --device-world, no --graph)"
            )
        if not (self.link_gbps > 0 and math.isfinite(self.link_gbps)):
            problems.append("--link-gbps must be a positive number")
        if not (self.link_latency_us >= 0 and math.isfinite(self.link_latency_us)):
            problems.append("--link-latency-us must not be negative")
        if not (self.attn_us >= 0 and math.isfinite(self.attn_us)):
            problems.append("--attn-us must not be negative")
        unknown = unknown_policies(self.policies)
        if unknown:
            problems.append(unknown)
        if "serial" not in self.policies:
            problems.append("--policies must include serial (the reference for speedup, eta and outputs)")
        if len(set(self.policies)) != len(self.policies):
            problems.append("--policies names a policy twice")
        if self.graph and self.device == "npu":
            problems.append(f"--device {self.device}: {GRAPH_NOT_ON_NPU}")
        problems += timing_problems(self.device, self.timing, self.most_comm_cores())
        if self.comm_ratio is not None and not (0 < self.comm_ratio < 10):
            problems.append("--comm-ratio must be above 0 and below 10")
        elif self.comm_ratio is not None and self.timing_mode()[0] != "model":
            problems.append(
                f"--comm-ratio sets the link from the FFN's modelled duration: it needs modelled timing "
                f"({self.timing_mode()[1]})"
            )
        if self.ffn_us is not None and not (self.ffn_us > 0 and math.isfinite(self.ffn_us)):
            problems.append("--ffn-us must be a positive number")
        elif self.ffn_us is not None and self.timing_mode()[0] != "model":
            problems.append(
                f"--ffn-us sets the FFN's modelled duration: it needs modelled timing ({self.timing_mode()[1]})"
            )
        if self.device_world and self.device == "cpu" and self.most_comm_cores():
            problems.append(
                "--device-world runs the comm kernel's host reference on the emulated device, which holds no "
                "cores: --comm-cores needs --device cuda (or the host world: leave out --device-world)"
            )
        if problems:
            raise ValueError("; ".join(problems))


#: Presets; a flag given explicitly on the command line overrides its value.
SCENARIOS: dict[str, dict[str, Any]] = {
    # FFN compute-bound: per (layer, stage) the FFN takes longer than its A2E
    # and E2A together, which are not negligible (measured f, a and e: the
    # bench table in docs/benchmark.md), and S * f exceeds one group's cycle
    # a + f + e + attn, so the compute stream is the bottleneck.
    "ffn-bound": {
        "layers": 6,
        "stages": 2,
        "tokens": 128,
        "hidden": 512,
        "ffn": 1024,
        "experts": 8,
        "top_k": 2,
        "link_latency_us": 500.0,
        "link_gbps": 0.8,
        "attn_us": 500.0,
        # the link is set from the FFN's modelled duration (modelled timing):
        # A2E + E2A take half of it, whatever this machine's FFN takes
        "comm_ratio": 0.5,
        "steps": 8,
        "warmup": 2,
        "reps": 3,
    },
}

SCENARIOS["gpu-ffn-bound"] = {
    # The same intent sized for a datacenter GPU, by estimate (no GPU was
    # lent to measure it; docs/validation.md, "Sizing gpu-ffn-bound"). The
    # FFN must be device-bound, or eager figures measure Python's launch
    # rate: the device FFN issues 18 kernels per (layer, stage) whatever the
    # experts (its experts batched into two GEMMs), about 0.1-0.2 ms of host
    # time, against ~464 GFLOP of dense bf16 work at 4096 tokens (two GEMMs
    # of 275 and 137 GFLOP, ~0.6 ms at 600-700 TFLOP/s on an H200, plus
    # ~0.3 ms of element-wise passes over 256 MiB blocks at ~4 TB/s): about
    # 1 ms, so an FFN's launch share is ~0.1-0.2. Communication per (layer,
    # stage): A2E 8 MiB and E2A 16 MiB over 50 us + 600 Gbit/s, ~0.16 and
    # ~0.27 ms, a+e ~0.44 f; FFN-bound while f > 0.49 ms. The report's
    # measured verdicts (ffn_bound, launch.launch_bound) say what it is there.
    "layers": 6,
    "stages": 2,
    "tokens": 4096,
    "hidden": 1024,
    "ffn": 2048,
    "experts": 8,
    "top_k": 2,
    "link_latency_us": 50.0,
    "link_gbps": 600.0,
    "attn_us": 50.0,
    "steps": 8,
    "warmup": 2,
    "reps": 3,
}

SCENARIOS["comm-heavy"] = {
    # Communication above the FFN: per (layer, stage) A2E + E2A take 1.25 f
    # (the link set from the FFN's modelled duration, as ffn-bound's), so the
    # layouts part: compute-side issues every stage's A2E and E2A on the one
    # caller's stream (S (a+e) = 2.5 f per layer there), comm-side on a
    # stream per stage (one stage group's cycle a+f+e+attn = 2.25 f + attn):
    # the shape for "adaptive with both layouts listed is within 3 % of the
    # better layout". Both layouts fixed and adaptive, and both listed.
    "layers": 4,
    "stages": 2,
    "tokens": 128,
    "hidden": 512,
    "ffn": 1024,
    "experts": 8,
    "top_k": 2,
    "link_latency_us": 500.0,
    "link_gbps": 0.8,
    "attn_us": 500.0,
    "comm_ratio": 1.25,
    "steps": 8,
    "warmup": 2,
    "reps": 3,
    "policies": ("serial", "overlap", "compute-side-fixed", "comm-side", "comm-side-fixed", "both"),
}

SCENARIO_HELP = {
    "ffn-bound": "FFN compute-bound: f > a + e with communication about half of f, 2 stages, 6 layers",
    "comm-heavy": "communication above the FFN (a + e = 1.25 f), 2 stages, 4 layers; both layouts fixed and "
    "adaptive, and both listed (policy both), side by side",
    "gpu-ffn-bound": "the same sized for a datacenter GPU (--device cuda) by estimate, device-bound (4096 tokens "
    "per stage); the report's measured verdicts say whether it is FFN-bound and device-bound there",
}


def link_for_ratio(params: BenchParams, f_s: float, ratio: float) -> tuple[float, float]:
    """(latency us, Gbit/s) making the modeled A2E + E2A of one (layer,
    stage) take ``ratio * f_s``. A2E moves tokens x hidden; E2A moves the
    routed and the shared expert outputs (twice that)."""
    itemsize = 4 if params.device == "cpu" else 2
    bytes_a = params.tokens * params.hidden * itemsize
    bytes_total = 3 * bytes_a
    target = ratio * f_s
    latency_s = min(params.link_latency_us * 1e-6, 0.2 * target / 2)
    transfer = target - 2 * latency_s
    gbps = bytes_total * 8 / transfer / 1e9
    return latency_s * 1e6, gbps


def linked_to_ffn(params: BenchParams, world: Any) -> BenchParams:
    """``params`` with the link that makes A2E + E2A take ``comm_ratio`` of
    the FFN's modelled duration, set on ``world``'s transport too."""
    model = world.runner.model.moe.timing
    f_s = model.model_s(params.tokens) if model is not None else None
    if not f_s:
        raise RuntimeError("--comm-ratio: the FFN has no modelled duration to set the link from")
    lat_us, gbps = link_for_ratio(params, f_s, params.comm_ratio)  # type: ignore[arg-type]
    params = replace(params, link_latency_us=round(lat_us, 3), link_gbps=round(gbps, 6))
    world.transport.link = params.link()
    return params


def resolve_params(explicit: Mapping[str, Any], scenario: str | None = None) -> BenchParams:
    """Defaults, then the scenario's preset, then every explicitly given value."""
    if scenario is not None and scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (choose from {', '.join(SCENARIOS)})")
    names = {f.name for f in fields(BenchParams)}
    values: dict[str, Any] = dict(SCENARIOS.get(scenario, {})) if scenario else {}
    for key, value in explicit.items():
        if key not in names:
            raise ValueError(f"unknown benchmark parameter {key!r}")
        if value is not None:
            values[key] = tuple(value) if key in ("policies", "comm_cores_sweep") else value
    link_given = any(explicit.get(k) is not None for k in ("link_latency_us", "link_gbps"))
    if link_given and explicit.get("comm_ratio") is None:
        values.pop("comm_ratio", None)  # a link given explicitly is the link
    timing_given = (
        explicit.get("timing") == "wall" or bool(values.get("comm_cores")) or any(values.get("comm_cores_sweep") or ())
    )
    if timing_given and explicit.get("comm_ratio") is None:
        values.pop("comm_ratio", None)  # wall-clock kernels: no model to set the link from
    values["scenario"] = scenario
    params = replace(BenchParams(), **values)
    params.validate()
    return params


# ---------------------------------------------------------------------------
# statistics


def use_tool_switch_interval() -> float:
    """Set :data:`TOOL_SWITCH_INTERVAL_S` for this process (the tools' entry
    points call this); returns the interval it replaced."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(TOOL_SWITCH_INTERVAL_S)
    return previous


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in 0..100)."""
    if not values:
        return float("nan")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


# ---------------------------------------------------------------------------
# worlds: CPU emulation, or the device emulation


TracedStep = tuple[list[TraceOp], dict[tuple[int, int], torch.Tensor], dict[tuple[int, int], int]]


@dataclass
class _Handle:
    world: Any
    backend: str
    sync: Callable[[], None]
    traced_step: Callable[[], TracedStep]
    attn_modeled: bool
    #: The CPU trace carries the session's event records and waits, which the
    #: edge checker needs; the device trace has op timings only.
    edges_checkable: bool
    #: How the emulated comm ops take time (sleep, busy cores, the device kernel).
    comm_model: str = ""
    close: Callable[[], None] = lambda: None
    #: After a step and its sync, outside the timed span: raise if the device
    #: peer model reports an A2E that gave up waiting.
    check: Callable[[], None] = lambda: None
    #: ``host`` (the CPU world, its transport and peers on the host) or
    #: ``device`` (the device world: static buffers, the peer on the device).
    world_kind: str = "host"
    #: Right after a capture: whether the captured step (its patch layer's variant)
    #: ran A2E/E2A on side streams (the side streams' names given).
    captured_engaged: Callable[[Any, set[str]], bool] = lambda graph, side: False
    #: Device memory figures for a capture into ``pool`` (:func:`_cuda_memory`); None: not measured.
    memory: Callable[[Any], dict[str, int | None]] | None = None
    #: The last traced step's host and device times (``tools/bench/launch.py``); None: not measured.
    launch_sample: Callable[[list[TraceOp]], dict[str, Any] | None] = lambda ops: None
    #: What fell back while the world was built (the report's ``fallbacks``).
    fallbacks: list[dict[str, str]] = field(default_factory=list)


def _graph_nodes_engaged(graph: Any, side_streams: set[str]) -> bool:
    """The emulated device's graph: whether a node of the captured step
    (for a ``VariantGraph``, of the patch layer's variant) is on a side stream."""
    g = graph.captured.ours if isinstance(graph, VariantGraph) else graph
    return any(name in side_streams for name, _, _ in g.nodes())


def _cpu_handle(params: BenchParams, root: str) -> _Handle:
    world = build_world(params.world_spec(), root=root)
    if params.attention == "coupled":
        from camp2p_overlap.emulation.coupled import couple_stages

        couple_stages(world)

    def traced() -> TracedStep:
        with recording(TraceRecorder()) as rec:
            out = world.run_step()
        return rec.ops(), out, dict(world.transport.peer_wait_ns)

    model = (
        f"busy-wait on {params.comm_cores} core(s) (link time and peer waits)"
        if params.comm_cores
        else "time.sleep (takes no compute)"
    )
    return _Handle(
        world, "cpu", lambda: None, traced, True, True, model, world.close, captured_engaged=_graph_nodes_engaged
    )


#: What :func:`_cuda_memory` measures, for the report.
CAPTURE_MEMORY_SOURCE = (
    "pool_bytes: what the capture added to the segments of the one graph pool (torch.cuda.memory_snapshot(), "
    "segment_pool_id == the runner's pool; the most precise figure: only the graph's memory, immune to "
    "empty_cache and to other streams' caches); device_free_bytes: device free memory before minus after "
    "(mem_get_info(): the driver's view, also the graph's instantiation and anything else on the device, in "
    "2 MiB pages); allocated_bytes: torch.cuda.memory_allocated() after minus before (tensors still allocated, "
    "not the pool's freed blocks the graph keeps); each after a synchronize and empty_cache(), around the "
    "capture step only (its warm-up steps run before); second_variant_bytes: the layer's own figure for its "
    "variant (mem_get_info around the second capture, stats()['graphs'])"
)
CAPTURE_MEMORY_NOT_MEASURED = (
    "not measured: the emulated device keeps no memory pool (its graphs hold the host tensors their kernels captured)"
)


def _cuda_memory(mod: Any) -> Callable[[Any], dict[str, int | None]]:
    """Device memory figures of ``mod`` (torch.cuda) for a capture into ``pool``."""

    def measure(pool: Any) -> dict[str, int | None]:
        mod.synchronize()
        mod.empty_cache()
        out: dict[str, int | None] = {"free": None, "allocated": None, "pool": None}
        try:
            out["free"] = int(mod.mem_get_info()[0])
        except Exception:  # noqa: BLE001 - a figure, not a failure
            pass
        try:
            out["allocated"] = int(mod.memory_allocated())
        except Exception:  # noqa: BLE001
            pass
        try:
            want = tuple(pool) if pool is not None else None
            out["pool"] = sum(
                int(seg.get("total_size", 0))
                for seg in mod.memory_snapshot()
                if want is not None and tuple(seg.get("segment_pool_id", ())) == want
            )
        except Exception:  # noqa: BLE001
            pass
        return out

    return measure


def _device_handle(params: BenchParams, root: str) -> _Handle:
    from camp2p_overlap.emulation.kernel_world import EMULATED, build_device_world

    kind = EMULATED if params.device == "cpu" else params.device
    dw = build_device_world(params.world_spec(), kind, root=root)
    world = dw.world
    peer = dw.kernels.models_peer

    def traced() -> TracedStep:
        dw.timing.active = True
        try:
            start = dw.timing.begin()
            out = world.run_step()
            dw.timing.end("step", None, None, start, world.transport.step)
        finally:
            dw.timing.active = False
        ops = dw.timing.resolve()
        dw.transport.check()
        return ops, out, dw.transport.peer_wait_ns

    cores = dw.kernels.comm_cores
    model = f"{dw.kernels.kind}" + (f", {cores} SM(s) held per op" if cores else ", 1 block, no shared memory")
    if kind == EMULATED:
        model = dw.kernels.kind
    return _Handle(
        world,
        "cpu" if kind == EMULATED else params.device,
        dw.mod.synchronize,
        traced,
        peer,
        False,
        model,
        close=dw.close,
        check=dw.transport.check,
        world_kind="device",
        # The streams the transport saw the captured step's A2E/E2A issued on.
        captured_engaged=lambda graph, side: len(dw.transport.op_streams) > 1,
        memory=_cuda_memory(dw.mod) if kind == "cuda" else None,
        launch_sample=lambda ops: launch_sample(ops, dw.timing.host_spans),
        fallbacks=list(dw.fallbacks),
    )


# ---------------------------------------------------------------------------
# the run


@dataclass
class PolicyStats:
    name: str
    per_layer_s: list[float] = field(default_factory=list)
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    engaged: list[bool] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    #: The attention peer's cycle (next A2E after E2A + attn) on every traced step.
    peer_violations: list[str] = field(default_factory=list)
    peer_checked: int = 0
    timeline: list[TraceOp] = field(default_factory=list)
    #: Every traced step's ops and A2E peer waits (kept for ``serial`` only: f, a, e come from them).
    traced: list[tuple[list[TraceOp], dict[tuple[int, int], int]]] = field(default_factory=list)
    #: Graph mode: timed replays, and graphs captured (one per graph key;
    #: two, serial and overlap, for the adaptive policy's key).
    replays: int = 0
    captured_variants: int = 0
    #: Graph mode, adaptive policy: timed replays per variant it ran.
    variant_replays: dict[str, int] = field(default_factory=dict)
    #: Graph mode, adaptive policy: what its graph chose (the report's ``graph_choice``).
    graph_choice: dict[str, Any] | None = None
    #: Whether its steps were traced for the edge checker (graph replays are not).
    edges_checkable: bool = True
    #: Graph mode: its capture (the report's ``capture``: graphs, pools, time, memory).
    capture: dict[str, Any] | None = None
    #: An adaptive policy (eager): the steps run before its bucket decided
    #: (warm-ups included), each as (time per layer, the path it took,
    #: whether it was a timed step); ``per_layer_s`` then holds its steady
    #: state only (timed steps after the decision), or, when it never
    #: decided, its timed learning steps (flagged noisy).
    learning: list[tuple[float, str, bool]] = field(default_factory=list)
    #: The decision its learning ended with (a layout or serial; None: still learning at the end).
    decision: str | None = None
    #: Its timed steps (eager) by the path each ran: a layout's name, or serial.
    layout_steps: dict[str, int] = field(default_factory=dict)
    #: Every traced step's host and device times (device world; ``tools/bench/launch.py``).
    launch: list[dict[str, Any]] = field(default_factory=list)
    #: Its modelled kernels against their model (``--timing model``).
    timing: TimingCounts = field(default_factory=TimingCounts)


@dataclass
class BenchRun:
    """What :func:`run_bench` returns: the JSON report and the last traced
    step of each policy (for ``--trace`` and ``--plot``)."""

    report: dict[str, Any]
    timelines: dict[str, list[TraceOp]]


class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, file=sys.stderr, desc=desc, unit="step", leave=False)

    def tick(self, policy: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(policy, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _config_for(policy: str, backend: str, *, graph: bool = False) -> OverlapConfig | None:
    """The policy's patch layer config (None: unpatched): :meth:`Policy.config`."""
    return POLICIES[policy].config(backend, graph=graph)


def _passthrough(backend: str) -> OverlapConfig:
    """The config of serial's traced pass-through steps: comm-side with both directions off, nothing left to
    engage, so every step runs upstream's loop through the wrappers (traced, everything on C)."""
    return OverlapConfig(
        enabled=True,
        backend=backend,  # type: ignore[arg-type]
        layouts=("comm-side",),
        a2e_on_side_stream=False,
        e2a_on_side_stream=False,
        adaptive=False,
    )


def policy_skips(params: BenchParams) -> dict[str, str]:
    """The policies this run leaves out, each with why: compute-side under
    coupled attention (it stalls); in graph mode, comm on side streams on
    the emulated NPU (refused there), and every adaptive policy after the
    first (one patch layer stays applied over the replays)."""
    skipped: dict[str, str] = {}
    held: str | None = None
    for name in params.policies:
        policy = POLICIES[name]
        if params.attention == "coupled" and "compute-side" in (policy.layouts or ()):
            skipped[name] = COUPLED_COMPUTE_SIDE
        elif params.graph and params.device == "cpu" and policy.comm_on_side():
            skipped[name] = GRAPH_COMM_ON_THE_EMULATED_NPU
        elif params.graph and policy.adaptive:
            if held is None:
                held = name
            else:
                skipped[name] = GRAPH_ONE_ADAPTIVE.format(held=held)
    return skipped


def run_policies(params: BenchParams) -> tuple[tuple[str, ...], dict[str, str]]:
    """The policies this run measures, and those it leaves out with why (:func:`policy_skips`)."""
    skipped = policy_skips(params)
    return tuple(p for p in params.policies if p not in skipped), skipped


def _compare(
    out: Mapping[tuple[int, int], torch.Tensor], ref: Mapping[tuple[int, int], torch.Tensor], where: str
) -> str | None:
    if set(out) != set(ref):
        return f"{where}: (layer, stage) keys differ"
    for key in sorted(ref):
        if not torch.equal(out[key], ref[key]):
            return f"{where}: output of (layer {key[0]}, stage {key[1]}) differs"
    return None


def run_bench(
    params: BenchParams,
    *,
    progress: bool = False,
    progress_desc: str = "bench",
    profile_trace: str | None = None,
    on_report: Callable[[dict[str, Any]], None] | None = None,
) -> BenchRun:
    """Run the benchmark described by ``params`` (see the module docstring).
    ``profile_trace`` (device runs only): also profile one overlapped step
    and write its device timelines there (``tools/bench/profile.py``).
    ``on_report``: called with a partial report (``"partial": true``, what is
    done in ``"progress"``) after the captures (``--graph``) and after each
    repetition, so that a run cut short leaves what it measured.
    ``params.comm_cores_sweep``: one run per value, side by side
    (:func:`_run_comm_cores_sweep`)."""
    if profile_trace and params.device == "cpu":
        raise ValueError(PROFILE_NEEDS_DEVICE)
    params.validate()
    if params.comm_cores_sweep:
        return _run_comm_cores_sweep(
            params, progress=progress, progress_desc=progress_desc, profile_trace=profile_trace, on_report=on_report
        )
    wall0 = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(params.threads)
    site = standin_site()
    try:
        host = params.device == "cpu" and not params.device_world
        handle = _cpu_handle(params, site.root) if host else _device_handle(params, site.root)
        if params.ffn_us is not None:  # given: every run with it holds the FFN to the same duration
            handle.world.runner.model.moe.timing = fixed_ffn(params.tokens, params.ffn_us * 1e-6)
        elif params.timing_mode()[0] == "model":  # the FFN's model, refined from the run's own schedules
            schedules = in_run_schedules([POLICIES[p] for p in run_policies(params)[0]], handle.backend)
            refine_ffn_in_run(handle.world, schedules, manifest=site.manifest, sync=handle.sync)
        if params.comm_ratio is not None:  # the link from the FFN's model, which is now known
            params = linked_to_ffn(params, handle.world)
        layers = tuple(handle.world.layer_list())
        stages = tuple(handle.world.spec.stage_ids)

        def emit(so_far: dict[str, PolicyStats], what: str) -> None:
            if on_report is not None:
                elapsed = time.perf_counter() - wall0
                on_report(_partial_report(params, handle, site.root, layers, stages, so_far, elapsed, what))

        run_all = _run_graph_policies if params.graph else _run_policies
        stats = run_all(params, handle, site.manifest, progress, progress_desc, emit)
        profiled = None
        if profile_trace:
            from camp2p_overlap.tools.bench.profile import profile_device_step

            profiled = profile_device_step(
                handle.world,
                kind=params.device,
                manifest=site.manifest,
                layers=layers,
                stages=stages,
                path=profile_trace,
            )
    finally:
        release_site(site)
        torch.set_num_threads(previous_threads)
        if "handle" in locals():
            handle.close()
    report = _report(params, handle, site.root, layers, stages, stats, time.perf_counter() - wall0)
    if profiled is not None:
        report["profile"] = profiled
    # (--graph: replays are not traced; only serial's eager traced step has a timeline)
    return BenchRun(report, {name: s.timeline for name, s in stats.items() if s.timeline})


#: Why every run of a --comm-cores-sweep takes wall-clock kernels (unless --timing says otherwise).
CONTENTION_SWEEP_TIMING = (
    "every run on wall-clock kernels: --comm-cores above 0 measures what the comm cores' busy-wait takes from "
    "the FFN, which a modelled FFN would hide, and the run at 0 runs as the others do, so that they compare"
)


def contention_runs(params: BenchParams) -> list[BenchParams]:
    """The runs of a ``--comm-cores-sweep``: each value's params, every run on the same timing (wall-clock
    kernels when a value is above 0 and ``--timing`` was left to its default), its link the flags' (no
    FFN model to set it from)."""
    timing = params.timing
    if params.most_comm_cores() and timing == "auto" and params.device == "cpu":
        timing = "wall"
    ratio = params.comm_ratio if timing != "wall" else None
    return [
        replace(params, comm_cores=n, comm_cores_sweep=(), timing=timing, comm_ratio=ratio)
        for n in params.comm_cores_sweep
    ]


def contention_row(report: Mapping[str, Any]) -> dict[str, Any]:
    """One run of a --comm-cores-sweep in brief (the report's ``contention.runs[]``)."""
    m = report["measured"]
    keys = ("speedup", "speedup_ci95", "eta", "eta_fill_drain", "outputs_equal", "engaged", "noisy")
    return {
        "comm_cores": report["params"]["comm_cores"],
        "comm_model": report["comm_model"],
        "timing": report["timing"]["model"],
        "floor_per_layer_us": m["floor_per_layer_us"],
        "floor_fill_drain_per_layer_us": m.get("floor_fill_drain_per_layer_us"),
        "outputs_equal": report["outputs_equal"],
        "policies": [
            {"policy": p["policy"], "per_layer_us": p["per_layer_us"]["median"], **{k: p.get(k) for k in keys}}
            for p in report["policies"]
        ],
    }


def with_contention(first: dict[str, Any], others: Sequence[Mapping[str, Any]], values: Sequence[int]) -> dict:
    """The report of a --comm-cores-sweep: the first value's run, with every run side by side in its
    ``contention`` (``runs``: each in brief, the first included; ``reports``: the other runs' full reports)."""
    reports = [first, *others]
    out = dict(first)
    out["contention"] = {
        "values": list(values),
        "timing": CONTENTION_SWEEP_TIMING if first["timing"]["model"] == "wall" else first["timing"]["why"],
        "runs": [contention_row(r) for r in reports],
        "reports": list(others),
    }
    out["outputs_equal"] = all(r["outputs_equal"] for r in reports)
    out["params"] = {**first["params"], "comm_cores_sweep": list(values)}
    out["wall_s"] = round(sum(r["wall_s"] for r in reports), 3)
    return out


def _run_comm_cores_sweep(
    params: BenchParams,
    *,
    progress: bool,
    progress_desc: str,
    profile_trace: str | None,
    on_report: Callable[[dict[str, Any]], None] | None,
) -> BenchRun:
    """The whole benchmark once per ``--comm-cores`` value of the sweep (:func:`contention_runs`), in one
    process; the report is the first run's with every run side by side (:func:`with_contention`), and
    ``on_report`` gets it after each run and each partial report of the current one."""
    runs = contention_runs(params)
    done: list[dict[str, Any]] = []
    first: BenchRun | None = None
    values = params.comm_cores_sweep
    for i, sub in enumerate(runs):

        def partial(report: dict[str, Any], i: int = i) -> None:
            if on_report is None:
                return
            what = f"--comm-cores {values[i]} ({i + 1} of {len(values)}): {report['progress']}"
            if i == 0:
                on_report({**with_contention(report, [], values[:1]), "progress": what})
            else:
                merged = with_contention(done[0], [*done[1:], report], values[: i + 1])
                on_report({**merged, "partial": True, "progress": what})

        run = run_bench(
            sub,
            progress=progress,
            progress_desc=f"{progress_desc} --comm-cores {values[i]}",
            profile_trace=profile_trace if i == 0 else None,
            on_report=partial,
        )
        first = first or run
        done.append(run.report)
        if on_report is not None and i + 1 < len(runs):
            merged = with_contention(done[0], done[1:], values[: i + 1])
            on_report({**merged, "partial": True, "progress": f"--comm-cores {values[i]} done"})
    assert first is not None
    return BenchRun(with_contention(done[0], done[1:], values), first.timelines)


#: Called with the policies' statistics so far and what is done (partial reports).
Emit = Callable[[dict[str, PolicyStats], str], None]


def _run_policies(
    params: BenchParams,
    handle: _Handle,
    manifest: Any,
    progress: bool,
    desc: str,
    emit: Emit = lambda stats, what: None,
) -> dict[str, PolicyStats]:
    world = handle.world
    layers = tuple(world.layer_list())
    stages = tuple(world.spec.stage_ids)
    policies, _ = run_policies(params)
    stats = {p: PolicyStats(p) for p in policies}
    reference: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
    timed_ids = range(params.warmup, params.warmup + params.steps)
    per_rep = len(policies) * (params.warmup + params.steps + 1) + params.steps - 1
    bar = _Progress(params.reps * per_rep, progress, desc)
    order = ["serial", *[p for p in policies if p != "serial"]]
    passthrough = _passthrough(handle.backend)
    # One engine per policy, kept over the repetitions (what adaptive engage
    # learned carries over, as in a serving process), applied per repetition.
    patch_layers = {p: emulated_patch_layer() for p in order}
    engines = {p: patch_layer.engine for p, patch_layer in patch_layers.items()}
    try:
        for rep in range(params.reps):
            for policy in order:
                st = stats[policy]
                engine = engines[policy]
                emulated_device.take_timing()  # between blocks: nothing of this policy's
                cfg = _config_for(policy, handle.backend)
                if cfg is not None:
                    engine.apply(config=cfg, manifest=manifest, strict=True)
                runtime = patch_layers[policy].runtime if cfg is not None else None
                learner = runtime if cfg is not None and cfg.adaptive else None
                try:
                    for sid in range(params.warmup + params.steps):
                        timed = sid >= params.warmup
                        # An adaptive policy's steps before its decision are
                        # its learning, reported apart from its steady state.
                        learning = learner is not None and _decision(learner) is None
                        before = _layout_counts(runtime)
                        world.steps_run = sid
                        t0 = time.perf_counter()
                        out = world.run_step()
                        handle.sync()
                        per_layer = (time.perf_counter() - t0) / len(layers)
                        handle.check()
                        path = _path_taken(runtime, before)
                        if learning:
                            st.learning.append((per_layer, path, timed))
                        elif timed:
                            st.per_layer_s.append(per_layer)
                            st.layout_steps[path] = st.layout_steps.get(path, 0) + 1
                        if timed:
                            _check_output(st, reference, sid, out, rep)
                        bar.tick(policy)
                    if learner is not None:
                        st.decision = _decision(learner)
                    if cfg is None:
                        # Serial: trace every timed step id again through the
                        # wrappers' pass-through path (upstream's loop; both
                        # directions off), so f, a and e come from as many
                        # samples, spread over the run, as the timings.
                        engine.apply(config=passthrough, manifest=manifest, strict=True)
                        traced_ids: Sequence[int] = timed_ids
                    else:
                        traced_ids = [timed_ids[-1]]
                    for sid in traced_ids:
                        world.steps_run = sid
                        ops, waits = _traced_checked_step(handle, st, reference, sid, rep, layers, stages, params)
                        bar.tick(policy)
                        if policy == "serial":
                            st.traced.append((ops, waits))
                finally:
                    if not engine.unpatch(timeout=30.0):
                        raise RuntimeError("the benchmark's patch engine could not unpatch; see the log")
                ran = ran_layout(ops)
                engaged = ran != "serial"
                if handle.edges_checkable:
                    expected, wrong = _expected_layout(policy, ran, len(stages) >= passthrough.min_stages)
                    if wrong:
                        st.violations.append(f"rep {rep}: {wrong}")
                    result = check_step(ops, expected_schedule(expected, layers, stages))
                    st.violations.extend(f"rep {rep}: {v}" for v in result.violations)
                st.engaged.append(engaged)
                st.timeline = ops
                st.timing.merge(emulated_device.take_timing())
                if policy != order[-1]:  # what a run cut short keeps: each policy as it ends
                    emit(stats, f"repetition {rep + 1} of {params.reps}: {policy} done")
            emit(stats, f"repetition {rep + 1} of {params.reps}")
    finally:
        bar.close()
    for st in stats.values():
        if st.learning and st.decision is None:  # no steady state: its timed learning steps stand in
            st.per_layer_s = [t for t, _, timed in st.learning if timed]
            for _, path, timed in st.learning:
                if timed:
                    st.layout_steps[path] = st.layout_steps.get(path, 0) + 1
    return stats


#: The layouts a traced step can run, by name (what :func:`ran_layout` tells apart).
_LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (COMPUTE_SIDE, COMM_SIDE, E2A_ONLY, A2E_ONLY)}


def ran_layout(ops: Iterable[TraceOp]) -> str:
    """The layout a traced step ran, read from where its ops ran: ``compute-side`` (the FFN off C: on F; the
    device world's timing trace names every stream but C after the op's stage), ``comm-side``, ``e2a-only`` or
    ``a2e-only`` (A2E and/or E2A on K_s), else ``serial`` (all on C)."""
    ops = list(ops)
    if any(o.kind == "ffn" and o.stream != COMPUTE_STREAM for o in ops):
        return COMPUTE_SIDE.name
    a = any(o.kind == "a2e" and o.stream != COMPUTE_STREAM for o in ops)
    e = any(o.kind == "e2a" and o.stream != COMPUTE_STREAM for o in ops)
    return {(True, True): COMM_SIDE.name, (False, True): E2A_ONLY.name, (True, False): A2E_ONLY.name}.get(
        (a, e), "serial"
    )


def expected_schedule(layout: str, layers: Sequence[int], stages: Sequence[int]) -> ExpectedSchedule:
    """What a step of ``layout`` (a name of :data:`_LAYOUTS`, or ``serial``) was planned to do."""
    lay = _LAYOUTS.get(layout)
    if lay is None:
        return ExpectedSchedule.serial(layers, stages)
    return ExpectedSchedule.of_layout(layers, stages, lay)


def _expected_layout(policy: str, ran: str, gate_open: bool) -> tuple[str, str | None]:
    """The layout ``policy``'s traced step must have run (the edge checker's schedule), and why the one it
    ran is wrong (None: it is not): a fixed policy its layout while the gate lets it engage; an adaptive
    policy the path it chose, one it lists or serial."""
    listed = POLICIES[policy].layout_names()
    if not listed or not gate_open:
        return "serial", None
    if not POLICIES[policy].adaptive:
        return listed[0], None
    if ran == "serial" or ran in listed:
        return ran, None
    return ran, f"ran the {ran} layout, which {policy} does not list ({', '.join(listed)})"


def _layout_counts(runtime: Any) -> dict[str, int]:
    """The patch layer's engaged steps per layout so far (none for serial's unpatched engine)."""
    return {} if runtime is None else dict(runtime.counters.to_dict()["layout_steps"])


def _path_taken(runtime: Any, before: Mapping[str, int]) -> str:
    """The layout the step just run engaged in (its count moved), else ``serial``."""
    after = _layout_counts(runtime)
    return next((name for name, n in after.items() if n > before.get(name, 0)), "serial")


def _decision(runtime: Any) -> str | None:
    """The decision of the runtime's one eager bucket (a layout name or ``serial``; None: learning, or no
    bucket yet)."""
    decisions = {b["decision"] for b in runtime.adaptive.snapshot()}
    return next(iter(decisions)) if len(decisions) == 1 and "learning" not in decisions else None


def _learning(st: PolicyStats, steady_median: float | None) -> dict[str, Any] | None:
    """An adaptive policy's learning: the steps it took before its decision
    (warm-ups included), the paths they ran (each layout it lists, and
    serial), their times per layer, and what they cost against the steady
    state (the chosen path and its re-probes)."""
    if not st.learning and st.decision is None:
        return None
    times = [t for t, _, _ in st.learning]
    extra = None if steady_median is None or st.decision is None else sum(t - steady_median for t in times)
    paths = [*POLICIES[st.name].layout_names(), "serial"] if st.name in POLICIES else ["serial"]
    return {
        "steps": len(st.learning),
        "decision": st.decision,
        "paths": {path: sum(1 for _, p, _ in st.learning if p == path) for path in paths},
        "per_layer_us": _per_layer(times),
        "extra_us_per_layer": None if extra is None else round(_us(extra), 1),
    }


def _graph_warmups(world: Any, sync: Callable[[], None], n: int) -> None:
    """Upstream's warm-up steps before a capture (``World.capture``'s, run
    apart from the capture step so that its memory is measured alone)."""
    dp = world.dp_metadata()
    for _ in range(n):
        world.steps_run += 1
        world.transport.begin_step(world.steps_run, world.layer_list(), sorted(dp))
        world.runner.execute_ffn_step(dp_metadata_list=dp, is_warmup=True)
        world.synchronize()
        sync()


def _graphs_of(graph: Any) -> list[Any]:
    """The graphs a captured key holds: upstream's and the patch layer's for a
    ``VariantGraph``, else the one."""
    if isinstance(graph, VariantGraph):
        return [g for g in (graph.captured.upstream, graph.captured.ours) if g is not None]
    return [graph]


def _pool_of(graph: Any) -> str:
    pool = getattr(graph, "pool", None)
    try:
        return repr(pool() if callable(pool) else pool)
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        return f"unknown ({type(exc).__name__})"


def _run_graph_policies(
    params: BenchParams,
    handle: _Handle,
    manifest: Any,
    progress: bool,
    desc: str,
    emit: Emit = lambda stats, what: None,
) -> dict[str, PolicyStats]:
    """``--graph``: the eager serial reference of every step id; each fixed
    policy's step captured once (its config applied, ``graph=True``, then
    unpatched); the one adaptive policy (``overlap`` by default) captured
    with both variants (``graph="adaptive"``) and its patch layer kept
    applied while every policy's warm-up and timed replays run round-robin,
    per repetition; serial's traced pass-through steps (module docstring)."""
    world = handle.world
    layers = tuple(world.layer_list())
    stages = tuple(world.spec.stage_ids)
    policies, _ = run_policies(params)
    order = ["serial", *[p for p in policies if p != "serial"]]
    # Replays leave no host trace for the edge checker; serial's traced steps are eager.
    stats = {p: PolicyStats(p, edges_checkable=p == "serial") for p in policies}
    warm_ids = range(params.warmup)
    timed_ids = range(params.warmup, params.warmup + params.steps)
    passthrough = _passthrough(handle.backend)
    patch_layers = {p: emulated_patch_layer() for p in order}
    per_rep = len(order) * (params.warmup + params.steps) + params.steps
    bar = _Progress(len(warm_ids) + len(timed_ids) + len(order) + params.reps * per_rep, progress, desc)
    # The streams a captured overlap variant runs work on: K_s (comm-side), F (compute-side).
    side_streams = {side_stream_name(s) for s in stages} | {FFN_STREAM}

    def engaged_in(policy: str, graph: Any, captures_before: int) -> bool:
        """Whether the policy's captured graph (its patch layer's variant) runs the overlap: work captured on a
        side stream; on the device world, which tells the comm ops' streams apart only, the FFN's F of
        compute-side is read from its patch layer's count of overlap captures."""
        if handle.captured_engaged(graph, side_streams):
            return True
        return (
            handle.world_kind == "device"
            and POLICIES[policy].streams()[2] == FFN_STREAM
            and (_overlap_captures(patch_layers[policy]) > captures_before)
        )

    # The reference: eager serial steps (engine unpatched) of every step id,
    # before anything is captured (a key with no graph runs eagerly).
    reference: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
    for sid in (*warm_ids, *timed_ids):
        world.steps_run = sid
        reference[sid] = world.run_step()
        handle.sync()
        handle.check()
        bar.tick("serial (eager reference)")
    captured: dict[str, dict[str, Any]] = {}
    #: The adaptive policy whose layer stays applied over the replays, if any.
    held: str | None = None

    def unpatch(policy: str) -> None:
        if not patch_layers[policy].engine.unpatch(timeout=30.0):
            raise RuntimeError("the benchmark's patch engine could not unpatch; see the log")

    pool = getattr(world.runner, "graph_pool", None)

    def capture(policy: str) -> Any:
        """The policy's warm-up steps, then its capture step alone, timed and
        its device memory measured; the captured entry taken from the runner."""
        _graph_warmups(world, handle.sync, max(params.warmup, 1))
        before = handle.memory(pool) if handle.memory is not None else None
        t0 = time.perf_counter()
        world_graph = world.capture(warmups=0)
        handle.sync()
        seconds = time.perf_counter() - t0
        after = handle.memory(pool) if handle.memory is not None else None
        handle.check()
        entry = world.take_graph()
        assert entry is not None and entry["graph"] is world_graph
        captured[policy] = entry
        graphs = _graphs_of(world_graph)

        def delta(key: str, sign: int) -> int | None:
            if before is None or after is None or before[key] is None or after[key] is None:
                return None
            return sign * (after[key] - before[key])  # type: ignore[operator]

        layer_graph: Mapping[str, Any] = {}
        if isinstance(world_graph, VariantGraph):
            entries = patch_layers[policy].runtime.stats().get("graphs", [])
            layer_graph = entries[-1] if entries else {}
        stats[policy].capture = {
            "graphs": len(graphs),
            "pools": sorted({_pool_of(g) for g in graphs}),
            "seconds": round(seconds, 4),
            "pool_bytes": delta("pool", 1),
            "device_free_bytes": delta("free", -1),
            "allocated_bytes": delta("allocated", 1),
            # The patch layer's own figure (mem_get_info): host memory on the emulated device, so not given there.
            "second_variant_bytes": layer_graph.get("extra_bytes") if handle.memory is not None else None,
        }
        bar.tick(policy)
        return world_graph

    def replay(policy: str, sid: int, rep: int, *, timed: bool) -> None:
        st = stats[policy]
        graph = captured[policy]["graph"]
        counts = dict(graph.captured.replays) if isinstance(graph, VariantGraph) else None
        world.put_graph(captured[policy])
        emulated_device.take_timing()  # what ran before is not this replay's
        try:
            world.steps_run = sid
            t0 = time.perf_counter()
            out = world.run_step()
            handle.sync()
            elapsed = time.perf_counter() - t0
        finally:
            world.take_graph()
        st.timing.merge(emulated_device.take_timing())
        handle.check()
        if timed:
            st.per_layer_s.append(elapsed / len(layers))
            st.replays += 1
            if counts is not None:  # which variant this replay ran
                for variant, n in graph.captured.replays.items():
                    if n > counts.get(variant, 0):
                        st.variant_replays[variant] = st.variant_replays.get(variant, 0) + 1
        _check_output(st, reference, sid, out, rep)
        bar.tick(policy)

    def trace_serial(rep: int) -> None:
        """Serial's traced pass-through steps of every timed step id (eager)."""
        st = stats["serial"]
        patch_layers["serial"].engine.apply(config=passthrough, manifest=manifest, strict=True)
        emulated_device.take_timing()
        try:
            for sid in timed_ids:
                world.steps_run = sid
                ops, waits = _traced_checked_step(handle, st, reference, sid, rep, layers, stages, params)
                st.traced.append((ops, waits))
                bar.tick("serial")
        finally:
            st.timing.merge(emulated_device.take_timing())
            unpatch("serial")
        if handle.edges_checkable:
            result = check_step(ops, ExpectedSchedule.serial(layers, stages))
            st.violations.extend(f"rep {rep}: {v}" for v in result.violations)
        st.timeline = ops

    try:
        # Capture the fixed policies: one graph each (one key: every stage at
        # --tokens), under the policy's config; kept after it is unpatched.
        for policy in (p for p in order if p not in ADAPTIVE_POLICIES):
            cfg = _config_for(policy, handle.backend, graph=True)
            if cfg is not None:
                patch_layers[policy].engine.apply(config=cfg, manifest=manifest, strict=True)
            try:
                before = _overlap_captures(patch_layers[policy])
                graph = capture(policy)
                engaged = engaged_in(policy, graph, before)
            finally:
                unpatch(policy)
            stats[policy].captured_variants += 1
            stats[policy].engaged.append(engaged)
        # The adaptive policy: both variants (GRAPH=adaptive); its patch layer stays
        # applied through every policy's replays (its graph chooses through
        # the patch layer's runtime; the fixed graphs replay only captured work).
        adaptive = [p for p in order if p in ADAPTIVE_POLICIES]
        assert len(adaptive) <= 1, "two engines cannot stay applied side by side"
        for policy in adaptive:
            cfg = _config_for(policy, handle.backend, graph=True)
            assert cfg is not None
            patch_layers[policy].engine.apply(config=cfg, manifest=manifest, strict=True)
            held = policy
            before = _overlap_captures(patch_layers[policy])
            graph = capture(policy)
            st = stats[policy]
            if isinstance(graph, VariantGraph):
                st.captured_variants += 2
                st.engaged.append(engaged_in(policy, graph, before))
            else:  # the second capture failed: the key kept upstream's graph
                st.captured_variants += 1
                st.engaged.append(False)
        emit(stats, "captures")
        deferred = []
        for rep in range(params.reps):
            for sid in warm_ids:
                for policy in order:
                    replay(policy, sid, rep, timed=False)
            for i, sid in enumerate(timed_ids):
                k = i % len(order)  # rotate who goes first, so no policy always follows another
                for policy in order[k:] + order[:k]:
                    replay(policy, sid, rep, timed=True)
            if held is None:
                trace_serial(rep)
            else:  # another engine cannot be applied beside the held one
                deferred.append(rep)
            emit(stats, f"repetition {rep + 1} of {params.reps}")
        if held is not None:
            runtime_stats = patch_layers[held].runtime.stats()
            stats[held].graph_choice = _graph_choice(runtime_stats, stats[held])
            policy, held = held, None
            unpatch(policy)  # puts upstream's graph back in the entry, releases the overlap variant
        for rep in deferred:
            trace_serial(rep)
    finally:
        if held is not None:
            unpatch(held)
        for entry in captured.values():
            entry["graph"].reset()  # closes the streams a graph made for itself
        bar.close()
    return stats


def _overlap_captures(patch_layer: Any) -> int:
    """How many captures of the patch layer took its overlap variant."""
    return int(patch_layer.runtime.counters.to_dict()["graph_captures"].get("overlap", 0))


def _graph_choice(runtime_stats: Mapping[str, Any], st: PolicyStats) -> dict[str, Any]:
    """What the adaptive graph chose (its key's ``stats()["graphs"]`` entry),
    with the timed replays per variant; ``decision`` is None when the key
    has no second variant (its capture failed: ``capture_failures``)."""
    failures = dict(runtime_stats.get("graph_capture_failures", {}))
    entries = runtime_stats.get("graphs", [])
    g = entries[0] if entries else {}
    return {
        "decision": g.get("decision"),
        "replays": dict(g.get("replays", {})),
        "timed_replays": {v: st.variant_replays.get(v, 0) for v in ("serial", "overlap")},
        "serial_median_ms": g.get("serial_median_ms"),
        "overlap_median_ms": g.get("overlap_median_ms"),
        "samples": dict(g.get("samples", {})),
        "capture_failures": failures,
    }


def _traced_checked_step(
    handle: Any, st: Any, reference: Any, sid: int, rep: int, layers: Any, stages: Any, params: Any
) -> tuple[Any, Any]:
    """One traced step of ``handle``: its outputs checked against the
    reference and, where attention is modeled, the peer's cycle checked;
    returns the trace's ops and the peers' waits."""
    ops, out, waits = handle.traced_step()
    sample = handle.launch_sample(ops)
    if sample is not None:
        st.launch.append(sample)
    _check_output(st, reference, sid, out, rep)
    if handle.attn_modeled:
        cycle = check_peer_cycle(ops, layers, stages, int(params.attn_us * 1e3), tolerance_ns=PEER_TOLERANCE_NS)
        st.peer_violations.extend(f"rep {rep} step {sid}: {v}" for v in cycle.violations)
        st.peer_checked += 1
    return ops, waits


def _check_output(
    st: PolicyStats,
    reference: dict[int, dict[tuple[int, int], torch.Tensor]],
    sid: int,
    out: dict[tuple[int, int], torch.Tensor],
    rep: int,
) -> None:
    if st.name == "serial" and sid not in reference:
        reference[sid] = out
        return
    st.compared += 1
    bad = _compare(out, reference[sid], f"rep {rep} step {sid}")
    if bad:
        st.mismatches.append(bad)


StepTerms = tuple[list[float], dict[int, list[float]], dict[int, list[float]]]


def _step_terms(
    samples: Iterable[tuple[list[TraceOp], dict[tuple[int, int], int]]], stages: Sequence[int]
) -> list[StepTerms]:
    """Per traced serial step: its FFN times, and its A2E (without the wait
    for the attention peer) and E2A times per stage, in seconds."""
    out = []
    for ops, waits in samples:
        f: list[float] = []
        a: dict[int, list[float]] = {s: [] for s in stages}
        e: dict[int, list[float]] = {s: [] for s in stages}
        for o in ops:
            if o.stream != COMPUTE_STREAM or o.stage not in a:
                continue
            if o.kind == "ffn":
                f.append(o.duration_ns / 1e9)
            elif o.kind == "a2e":
                a[o.stage].append(max(o.duration_ns - waits.get((o.layer, o.stage), 0), 0) / 1e9)
            elif o.kind == "e2a":
                e[o.stage].append(o.duration_ns / 1e9)
        out.append((f, a, e))
    return out


def _medians(terms: Sequence[StepTerms], stages: Sequence[int]) -> tuple[float, dict[int, float], dict[int, float]]:
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    f = med([x for t in terms for x in t[0]])
    a = {s: med([x for t in terms for x in t[1][s]]) for s in stages}
    e = {s: med([x for t in terms for x in t[2][s]]) for s in stages}
    return f, a, e


def _floor_terms(
    f: float, a: Mapping[int, float], e: Mapping[int, float], stages: Sequence[int], attn_s: float
) -> tuple[float, float]:
    """(S·f, the longest stage group cycle a_s + f + e_s + attn): the floor is their max."""
    return len(stages) * f, max(a[s] + f + e[s] + attn_s for s in stages)


def _fill_drain_terms(
    f: float, a: Mapping[int, float], e: Mapping[int, float], stages: Sequence[int], attn_s: float, layers: int
) -> tuple[float, float]:
    """Per layer, what no layout can hide over a step of ``layers`` layers: (S·f with the step's fill and
    drain, (a_first + L·S·f + e_last) / L, and the longest stage group's chain over the step,
    (L·(a_s + f + e_s) + (L-1)·attn) / L): the fill/drain floor is their max. The step's first FFN needs its
    A2E (the first stage's, of the first layer) done, its last E2A (the last stage's, of the last layer)
    follows its last FFN, and the FFNs run one at a time on one stream (C or F) in the loop's order; a stage's
    chain has no attention after the step's last E2A."""
    first, last = stages[0], stages[-1]
    compute = (a[first] + layers * len(stages) * f + e[last]) / layers
    chain = max(layers * (a[s] + f + e[s]) + (layers - 1) * attn_s for s in stages) / layers
    return compute, chain


def _floor_s(terms: Sequence[StepTerms], stages: Sequence[int], attn_s: float) -> float:
    return max(_floor_terms(*_medians(terms, stages), stages, attn_s))


def _fill_drain_floor_s(terms: Sequence[StepTerms], stages: Sequence[int], attn_s: float, layers: int) -> float:
    return max(_fill_drain_terms(*_medians(terms, stages), stages, attn_s, layers))


def _measure(terms: Sequence[StepTerms], stages: Sequence[int], attn_s: float, layers: int) -> dict[str, Any]:
    f, a_med, e_med = _medians(terms, stages)
    S = len(stages)
    compute, chain = _floor_terms(f, a_med, e_med, stages, attn_s)
    fd_compute, fd_chain = _fill_drain_terms(f, a_med, e_med, stages, attn_s, layers)
    comm = max(a_med[s] + e_med[s] for s in stages)
    return {
        "source": "serial traced steps of every repetition (pass-through wrappers, both directions off: "
        "upstream's loop), interleaved with the policies' timed steps",
        "samples": sum(len(t[0]) for t in terms),
        "f_us": _us(f),
        "stages": [{"stage": s, "a_us": _us(a_med[s]), "e_us": _us(e_med[s])} for s in stages],
        "attn_us": _us(attn_s),
        "comm_over_ffn": round(comm / f, 4) if f > 0 else None,
        "ffn_bound": bool(f > comm and compute >= chain and S >= 2),
        "floor_per_layer_us": _us(max(compute, chain)),
        "floor_terms": {"stages_x_f_us": _us(compute), "group_cycle_us": _us(chain)},
        "floor_fill_drain_per_layer_us": _us(max(fd_compute, fd_chain)),
        "floor_fill_drain_terms": {
            "fill_us": _us(a_med[stages[0]]),
            "drain_us": _us(e_med[stages[-1]]),
            "layers": layers,
            "compute_us": _us(fd_compute),
            "group_chain_us": _us(fd_chain),
        },
    }


def _eta(t_serial: float, t_policy: float, t_floor: float) -> float | None:
    hideable = t_serial - t_floor
    return (t_serial - t_policy) / hideable if hideable > ETA_MIN_HIDEABLE * t_serial else None


def _interval(values: Sequence[float]) -> list[float] | None:
    if len(values) < 20:
        return None
    ordered = sorted(values)
    return [round(percentile(ordered, 2.5), 4), round(percentile(ordered, 97.5), 4)]


def _bootstrap(
    serial: Sequence[float],
    policy: Sequence[float],
    terms: Sequence[StepTerms],
    stages: Sequence[int],
    attn_s: float,
    rng: random.Random,
    layers: int = 1,
) -> tuple[list[float] | None, list[float] | None, list[float] | None]:
    """95% percentile intervals of speedup, eta and eta against the
    fill/drain floor: serial and policy step times and the traced serial
    steps (for the floors) resampled with replacement, each statistic
    recomputed per resample."""
    speedups: list[float] = []
    etas: list[float] = []
    etas_fd: list[float] = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        ts = statistics.median(rng.choices(serial, k=len(serial)))
        tp = statistics.median(rng.choices(policy, k=len(policy)))
        speedups.append(ts / tp)
        if terms:
            sample = rng.choices(terms, k=len(terms))
            eta = _eta(ts, tp, _floor_s(sample, stages, attn_s))
            if eta is not None:
                etas.append(eta)
            eta_fd = _eta(ts, tp, _fill_drain_floor_s(sample, stages, attn_s, layers))
            if eta_fd is not None:
                etas_fd.append(eta_fd)
    enough = BOOTSTRAP_RESAMPLES // 2
    return (
        _interval(speedups),
        _interval(etas) if len(etas) >= enough else None,
        _interval(etas_fd) if len(etas_fd) >= enough else None,
    )


def _noise(
    speedup: float,
    ci: list[float] | None,
    eta: float | None,
    eta_ci: list[float] | None,
    eta_fd: float | None = None,
    eta_fd_ci: list[float] | None = None,
) -> list[str]:
    """Why a policy's figures are noise rather than facts (empty: they are not)."""
    out = []
    if eta is not None and eta > 1:
        out.append(f"eta {eta:.2f} is above 1, which no schedule can reach")
    if eta_fd is not None and eta_fd > 1:
        out.append(f"eta against the fill/drain floor {eta_fd:.2f} is above 1, which no schedule can reach")
    for name, value, interval in (
        ("speedup", speedup, ci),
        ("eta", eta, eta_ci),
        ("eta against the fill/drain floor", eta_fd, eta_fd_ci),
    ):
        if value is not None and interval is not None and (interval[1] - interval[0]) / 2 > NOISY_HALF_WIDTH:
            out.append(f"the 95% interval of {name} is wider than +/-{NOISY_HALF_WIDTH:g}")
    return out


def _per_layer(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p90": None, "min": None, "mean": None}
    return {
        "median": _us(statistics.median(values)),
        "p90": _us(percentile(values, 90)),
        "min": _us(min(values)),
        "mean": _us(statistics.fmean(values)),
    }


def _report(
    params: BenchParams,
    handle: _Handle,
    root: str,
    layers: Sequence[int],
    stages: Sequence[int],
    stats: dict[str, PolicyStats],
    wall_s: float,
    progress: str | None = None,
) -> dict[str, Any]:
    """The JSON report; ``progress`` (a partial report): what is done so far
    (a policy with no timed step yet has null figures)."""
    attn_s = params.attn_us * 1e-6 if handle.attn_modeled else 0.0
    mode, why = params.timing_mode()
    total = TimingCounts()
    for st in stats.values():
        total.merge(st.timing)
    terms = _step_terms(stats["serial"].traced, stages)
    measured = _measure(terms, stages, attn_s, len(layers))
    serial_s = stats["serial"].per_layer_s
    t_serial = statistics.median(serial_s) if serial_s else None
    t_floor = measured["floor_per_layer_us"] / 1e6
    t_floor_fd = measured["floor_fill_drain_per_layer_us"] / 1e6
    rng = random.Random(params.seed)
    policies = []
    for name in (n for n in params.policies if n in stats):
        st = stats[name]
        policy = POLICIES[name]
        streams = policy.streams()
        med = statistics.median(st.per_layer_s) if st.per_layer_s else None
        speedup = eta = eta_fd = speedup_ci = eta_ci = eta_fd_ci = None
        noise: list[str] = []
        if t_serial is not None and med is not None:
            speedup = round(t_serial / med, 4)
            if name != "serial":
                raw_eta = _eta(t_serial, med, t_floor)
                eta = None if raw_eta is None else round(raw_eta, 4)
                raw_fd = _eta(t_serial, med, t_floor_fd)
                eta_fd = None if raw_fd is None else round(raw_fd, 4)
                speedup_ci, eta_ci, eta_fd_ci = _bootstrap(
                    serial_s, st.per_layer_s, terms, stages, attn_s, rng, len(layers)
                )
                if eta is None:
                    eta_ci = None
                if eta_fd is None:
                    eta_fd_ci = None
                noise = _noise(t_serial / med, speedup_ci, eta, eta_ci, eta_fd, eta_fd_ci)
                if st.learning and st.decision is None:
                    noise.append("adaptive engage was still learning at the end: not its steady state")
        policy_timing = st.timing.to_dict() if mode == "model" else None
        noise += timing_noise(policy_timing)
        policies.append(
            {
                "policy": name,
                "layouts": list(policy.layout_names()) if policy.layouts is not None else None,
                "a2e_side_stream": streams[0] != COMPUTE_STREAM,
                "e2a_side_stream": streams[1] != COMPUTE_STREAM,
                "ffn_side_stream": streams[2] != COMPUTE_STREAM,
                "layout_steps": dict(st.layout_steps),
                "samples": len(st.per_layer_s),
                "per_layer_us": _per_layer(st.per_layer_s),
                "adaptive": name in ADAPTIVE_POLICIES,
                "learning": _learning(st, med),
                "speedup": speedup,
                "speedup_ci95": speedup_ci,
                "eta": eta,
                "eta_ci95": eta_ci,
                "eta_fill_drain": eta_fd,
                "eta_fill_drain_ci95": eta_fd_ci,
                "noisy": bool(noise),
                "noise": noise,
                "outputs_equal": not st.mismatches,
                "compared_steps": st.compared,
                "mismatches": st.mismatches[:10],
                "engaged": all(st.engaged) and bool(st.engaged),
                "replays": st.replays,
                "captured_variants": st.captured_variants,
                "capture": st.capture,
                "graph_choice": st.graph_choice,
                "edges_checked": handle.edges_checkable and st.edges_checkable,
                "edges_ok": (not st.violations) if handle.edges_checkable and st.edges_checkable else None,
                "edge_violations": st.violations[:10],
                "peer_cycle_ok": (not st.peer_violations) if st.peer_checked else None,
                "peer_cycle_checked_steps": st.peer_checked,
                "peer_cycle_violations": st.peer_violations[:10],
                "launch": launch_summary(st.launch),
                "timing": policy_timing,
            }
        )
    measured["launch"] = launch_verdict(
        launch_summary(stats["serial"].launch), {p["policy"]: p["launch"] for p in policies}
    )
    return {
        "schema": SCHEMA,
        "version": camp2p_overlap.__version__,
        "partial": progress is not None,
        "progress": progress or "done",
        "device": params.device,
        "backend": handle.backend,
        "world": handle.world_kind,
        "scenario": params.scenario,
        "graph": params.graph,
        "graph_pool": _graph_pool(handle, stats) if params.graph else None,
        "skipped_policies": [{"policy": name, "why": why} for name, why in run_policies(params)[1].items()],
        "attention": params.attention,
        "stand_in_root": root,
        "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(params).items()},
        "comm_model": handle.comm_model,
        "fallbacks": list(handle.fallbacks),
        "attn_modeled": handle.attn_modeled,
        "timing": timing_report(mode, why, ffn=_ffn_timing(handle), attn_us=_us(attn_s), total=total),
        "ffn_layers": len(layers),
        "stages": list(stages),
        "measured": measured,
        "policies": policies,
        "layouts_compared": layouts_compared(policies),
        "contention": None,
        "outputs_equal": all(p["outputs_equal"] for p in policies),
        "env": report_env(params.threads),
        "wall_s": round(wall_s, 3),
    }


#: The policies that stand for each layout in :func:`layouts_compared`, in the order preferred (fixed first).
LAYOUT_POLICIES = {
    "compute-side": ("compute-side-fixed", "overlap"),
    "comm-side": ("comm-side-fixed", "comm-side"),
}


def layouts_compared(policies: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The two layouts side by side, where the run has a policy of each (None: it has not): each layout's
    per-layer median (its fixed policy, else its adaptive one), the better of them, and each adaptive
    policy's steady state against that better one (``vs_better``: T_better / T_policy; the goal is within
    :data:`LAYOUT_TOLERANCE` of it, ``vs_better >= 1 - LAYOUT_TOLERANCE``)."""
    by = {p["policy"]: p for p in policies}

    def median(p: Mapping[str, Any]) -> float | None:
        return (p.get("per_layer_us") or {}).get("median")

    chosen = {}
    for layout, names in LAYOUT_POLICIES.items():
        name = next((n for n in names if n in by and median(by[n]) is not None), None)
        if name is None:
            return None
        chosen[layout] = {"policy": name, "per_layer_us": median(by[name])}
    better = min(chosen, key=lambda k: chosen[k]["per_layer_us"])
    best_us = chosen[better]["per_layer_us"]
    adaptive = []
    for p in policies:
        if p.get("adaptive") and median(p):
            ratio = round(best_us / median(p), 4)
            adaptive.append(
                {
                    "policy": p["policy"],
                    "layouts": p.get("layouts"),
                    "per_layer_us": median(p),
                    "vs_better": ratio,
                    "within_tolerance": ratio >= 1 - LAYOUT_TOLERANCE,
                }
            )
    return {"layouts": chosen, "better": better, "tolerance": LAYOUT_TOLERANCE, "adaptive": adaptive}


def _ffn_timing(handle: _Handle) -> Any:
    """The FFN's timing model of the run (None: none)."""
    model = getattr(handle.world.runner, "model", None)
    return getattr(getattr(model, "moe", None), "timing", None)


def _graph_pool(handle: _Handle, stats: Mapping[str, PolicyStats]) -> dict[str, Any]:
    """Where every policy's graphs live: the runner's one graph pool, and
    how capture memory was measured."""
    runner_pool = _pool_of(SimpleNamespace(pool=getattr(handle.world.runner, "graph_pool", None)))
    seen = sorted({pool for st in stats.values() if st.capture for pool in st.capture["pools"]})
    return {
        "pool": runner_pool,
        "pools_seen": seen,
        "one_pool": seen == [runner_pool],
        "graphs": sum(st.capture["graphs"] for st in stats.values() if st.capture),
        "memory": CAPTURE_MEMORY_SOURCE if handle.memory is not None else CAPTURE_MEMORY_NOT_MEASURED,
    }


def _no_nan(value: Any) -> Any:
    """``value`` with every NaN float replaced by None (strict JSON)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def _partial_report(
    params: BenchParams,
    handle: _Handle,
    root: str,
    layers: Sequence[int],
    stages: Sequence[int],
    stats: dict[str, PolicyStats],
    wall_s: float,
    progress: str,
) -> dict[str, Any]:
    """The report so far (``run_bench``'s ``on_report``); figures not
    measured yet are null."""
    return _no_nan(_report(params, handle, root, layers, stages, stats, wall_s, progress=progress))
