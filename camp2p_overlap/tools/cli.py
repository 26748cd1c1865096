"""``camp2p-overlap {bench,sweep,overhead,doctor,docs}``."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

from camp2p_overlap.tools.bench.runner import (
    ATTENTION_CHOICES,
    POLICY_HELP,
    SCENARIO_HELP,
    SCENARIOS,
    BenchParams,
    unknown_policies,
)
from camp2p_overlap.tools.docgen import help_listing, reading_rules
from camp2p_overlap.tools.overhead import OverheadParams

BENCH_DESCRIPTION = """\
Benchmark the FFN-side CAMP2P overlap on an emulated FFN rank: stand-ins of
afd-plugin's runner and connector (at the real dotted path afd_plugin unless a
real afd-plugin is installed), attention peers with real data dependencies,
a modeled link, and a MoE FFN doing real tensor work. Each policy runs
through the same patch engine and wrappers users get; policies are
interleaved over repetitions in one process. The layouts: compute-side (the
users' default: A2E/E2A on the caller's stream C in the overlap's order, the
FFN on the runner's side stream F) and comm-side (A2E/E2A on per-stage side
streams K_s, the FFN on C).

policies:
""" + "\n".join(
    textwrap.fill(text, 79, initial_indent=f"  {name:<19}", subsequent_indent=" " * 21)
    for name, text in POLICY_HELP.items()
)

BENCH_EPILOG = """\
what is reported:
  per-layer time  a step's wall time / its number of FFN layers; median and
                  p90 over every timed step of every repetition
  speedup         median(serial) / median(policy)
  f, a, e         measured on the serial run's trace: every timed step id is
                  run again, traced, through the wrappers' pass-through path
                  (upstream's loop, both directions off). f: median FFN
                  compute per (layer, stage); a_s, e_s: per stage, median
                  A2E (without the time it waited for its attention peer)
                  and E2A. attn is the modeled attention time (--attn-us)
  floor           per layer: max(S*f, max over stages of a_s + f + e_s + attn).
                  S*f is the FFN stream's work; a+f+e+attn is one stage
                  group's dependency cycle (A2E, its FFN, E2A, then attention
                  before the next A2E), which no schedule can shorten
  fill/drain      per layer: max((a_first + L*S*f + e_last) / L,
  floor           max over stages of (L*(a_s+f+e_s) + (L-1)*attn) / L): also
                  the step's first A2E and last E2A, which no layout can hide
  eta             (T_serial - T_policy) / (T_serial - T_floor): the share of the
                  hideable time hidden (1.0 = all of it); eta f/d the same
                  against the fill/drain floor
  outputs         every timed and traced step of every policy compared bitwise
                  (torch.equal) with the serial run of the same step id
  edges           the trace checker (camp2p_overlap.verify.edges.check_step) on each
                  policy's traced step (CPU; on a device see --profile-trace)
  peer cycle      on every traced step, each stage's next A2E completed no
                  earlier than its previous E2A started plus the attention time
                  (camp2p_overlap.verify.peer_cycle.check_peer_cycle)
  --graph         per-layer times are replays (speedup against serial's graph,
                  eta as above); every graph in the runner's one pool
                  (graph_pool); per policy its capture step's time and, on
                  cuda, the memory it added to the pool (capture.pool_bytes)
  --json          written as the run goes ("partial": true after the captures,
                  each policy (eager) and each repetition), then the final report
  launch share    device world: host time to issue an FFN (or a step) over its
                  device time, from timing events; LAUNCH-BOUND at 0.8 or more
                  (the figures then measure the host's launch rate)

--device cpu: every stream, the compute stream included, is a worker thread
of the emulated device; with --timing model (the default) each kernel takes
its modelled duration (docs/benchmark.md, "Timing model"). --device cuda|npu: bf16 FFN matmuls on the
device; on CUDA each A2E/E2A is an emulated CAM kernel that waits for the
attention peer on the device, then spins the link time on the device clock
(npu, or no NVRTC: calibrated device work, no peer). --comm-cores N: each
communication op keeps N cores (cpu) or SMs (cuda) busy; --comm-cores-sweep
0,N runs the whole benchmark at each value and reports them side by side.
--attention coupled: the peer couples the stages (host world; compute-side
stalls there and is not run). Exit status: 0, or 1
when outputs differ, an edge or the peer cycle is violated or an overlap
policy did not engage (2+ stages).
Absolute CPU times say nothing about an NPU; only the ratios carry over.
--json schema: docs/benchmark.md.
"""

DOCTOR_EPILOG = """\
exit status: 0 when nothing would refuse, else 1.

--json schema (camp2p-overlap/doctor/v1; also in docs/benchmark.md):
  schema        "camp2p-overlap/doctor/v1"
  ok            true when problems is empty
  problems      [str]: everything that would refuse or keep the overlap off
  notes         [str]: worth knowing, not a problem (e.g. the switch is off)
  stack         manifest stack checked, e.g. "vllm-0.19.1"
  stack_match   {stack (matched, or null), describe, why, afd_plugin_source,
                 candidates: [{stack, describe, ok, reason}] (every shipped stack's verdict),
                 vllm_ascend: {expected, found, status (ok|differs|not-installed|unknown), detail}}
  versions      {vllm, torch, torch_npu, wrapt, afd-plugin, vllm-ascend, camp2p-overlap}: str or null
  vllm_check    {ok, found, supported, reason}
  targets       [{target, module, qualname, action (wrap|read), status, detail}]
                status: ok | import-error | missing | signature-mismatch | stand-in
  device        "npu" | "cuda" | null;  device_detail: str
  backend       {configured, resolved (npu|cuda|cpu|null), reason}
  config        {ok, error (str|null), enabled, mode, rung, ladder, layouts_listed, layouts, graph_comm_side,
                switches: [{name, raw, field, value, description}]}
  decode_graphs {status (ok|refused|off), reason}: a refusal is also a problem
  deployment    null without --config; else {source, connector, role, num_ubatches, num_ubatches_from,
                stages: [{stage, group, in_use, error, shares_group_with}], aliased: {group: [stage]},
                extra: {core_num, ffn_core_num, attn_core_num, aiv_num}, mode, rung, problems, notes}

switches (the environment variables the layer reads in every vLLM process):
""" + "\n".join(
    [textwrap.fill(reading_rules(markdown=False), 79, initial_indent="  ", subsequent_indent="  "), help_listing()]
)

_DEFAULTS = BenchParams()

#: (flag, field, type, help)
_WORLD_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--layers", "layers", int, "FFN layers per step"),
    ("--stages", "stages", int, "micro-batch stages per step, 1-3 (CAMP2P groups afd, afd1, afd2)"),
    ("--tokens", "tokens", int, "tokens per stage"),
    ("--hidden", "hidden", int, "hidden size"),
    ("--ffn", "ffn", int, "expert intermediate size"),
    ("--experts", "experts", int, "routed experts"),
    ("--top-k", "top_k", int, "experts per token"),
    ("--link-latency-us", "link_latency_us", float, "modeled link latency per op, microseconds"),
    ("--link-gbps", "link_gbps", float, "modeled link bandwidth, Gbit/s"),
    ("--attn-us", "attn_us", float, "modeled attention time between a stage's E2A and its next A2E, microseconds"),
    ("--steps", "steps", int, "timed steps per policy and repetition"),
    ("--warmup", "warmup", int, "warm-up steps per policy and repetition"),
    ("--reps", "reps", int, "repetitions (policies interleaved in each)"),
    ("--seed", "seed", int, "seed of weights and inputs"),
    ("--threads", "threads", int, "torch.set_num_threads for the run (fixed so runs compare)"),
    (
        "--comm-cores",
        "comm_cores",
        int,
        "cores each emulated A2E/E2A keeps busy while it waits for its peer and moves data, as CAM's kernels "
        "spin on aiv_num vector cores: CPU threads busy-waiting (cpu), SMs held by the comm kernel (cuda); "
        "0: communication takes no compute",
    ),
]


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = unknown_policies(names)
    if unknown:
        raise argparse.ArgumentTypeError(unknown)
    return names


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _ints_or_none(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    values = _ints(text)
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def _ints_or_zero(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    values = _ints(text)
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be 0 or more")
    return values


def _add_world_flags(p: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    shown = {f.name: getattr(_DEFAULTS, f.name) for f in fields(BenchParams)}
    shown.update(defaults or {})
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default=None, help="where to run (default cpu)")
    p.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default=None,
        help="a preset; flags given explicitly override it. "
        + "; ".join(f"{k}: {v}" for k, v in SCENARIO_HELP.items()),
    )
    for flag, name, typ, text in _WORLD_FLAGS:
        p.add_argument(flag, dest=name, type=typ, default=None, help=f"{text} (default {shown[name]})")
    p.add_argument(
        "--timing",
        choices=("model", "wall"),
        default=None,
        help="how a kernel of the CPU's emulated device takes time: model (the default on the CPU: the FFN "
        "takes its duration calibrated at the start of the run, A2E/E2A their link model, each kernel holds its "
        "stream until its modelled end; overruns are reported and a run whose overruns exceed 1 %% of modelled "
        "time is flagged) or wall (wall-clock kernels: their times follow the CPU's speed and thread "
        "scheduling; the default with --comm-cores). --device cuda|npu: device time, no flag",
    )
    p.add_argument(
        "--ffn-us",
        dest="ffn_us",
        type=float,
        default=None,
        help="with --timing model: the FFN kernel's modelled duration in microseconds, given instead of calibrated "
        "(e.g. another run's timing.ffn.points[].model_us, so that the two compare exactly)",
    )
    p.add_argument(
        "--comm-ratio",
        dest="comm_ratio",
        type=float,
        default=None,
        help="with --timing model: set the modelled link once the FFN's model is known, so that A2E + E2A of one "
        "(layer, stage) take this share of it (the ffn-bound preset: 0.5; the sweep sets each point's link itself; "
        "--link-latency-us/--link-gbps given "
        "explicitly set the link instead)",
    )
    p.add_argument(
        "--policies",
        type=_policies,
        default=None,
        help=f"comma-separated, must include serial (default {','.join(shown['policies'])}; the comm-heavy "
        "scenario's: every layout, fixed and adaptive, and both)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default=None,
        help="the attention side: per-stage (default: a stage's next A2E waits for that stage's E2A alone, as "
        "vLLM's DBO micro-batching) or coupled (it waits for every stage's E2A of the layer, "
        "emulation/coupled.py; the host world only; compute-side stalls there and is not run, with the reason)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is shown only on a terminal)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="camp2p-overlap",
        description="FFN-side CAMP2P A2E/E2A multi-stream overlap for vLLM + afd-plugin (0.19.1, 0.26.0): tools.",
        epilog="The VLLM_CAMP2P_* environment variables that configure the layer: camp2p-overlap doctor --help.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{bench,sweep,overhead,doctor,docs}")
    sub.required = True

    bench = sub.add_parser(
        "bench",
        help="serial vs e2a-only vs both overlap layouts on the emulated FFN rank",
        description=BENCH_DESCRIPTION,
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_world_flags(bench)
    bench.add_argument(
        "--comm-cores-sweep",
        dest="comm_cores_sweep",
        type=_ints_or_zero,
        default=None,
        metavar="N,M,...",
        help="run the whole benchmark once per --comm-cores value (e.g. 0,2: the contention model off and on) and "
        "report the runs side by side (the report's contention; the first value's run is the report's main "
        "figures); every run on wall-clock kernels when a value is above 0 (unless --timing says otherwise)",
    )
    bench.add_argument("--json", metavar="PATH", help="write the report as JSON (schema: docs/benchmark.md)")
    bench.add_argument(
        "--ffn-ranks",
        dest="ffn_ranks",
        type=int,
        default=None,
        metavar="N",
        help="the multi-rank main job instead: N FFN ranks and --attn-ranks attention ranks as processes over gloo "
        "(loopback), a MoE all-to-all among the FFN ranks in each FFN, adaptive engage deciding as one group; "
        "reports the group's speedup, eta against the fill/drain floor, a straggler world, and the steps on which "
        "the FFN ranks ran different paths (docs/benchmark.md, 'The multi-rank main job')",
    )
    bench.add_argument("--attn-ranks", dest="attn_ranks", type=int, default=None, metavar="M", help="default: N")
    bench.add_argument(
        "--rank-steps", dest="rank_steps", type=int, default=None, metavar="K", help="steps per world (200)"
    )
    bench.add_argument(
        "--rank-reps", dest="rank_reps", type=int, default=None, metavar="R", help="repetitions of the worlds (3)"
    )
    bench.add_argument(
        "--rank-ffn-ms",
        dest="rank_ffn_ms",
        type=float,
        default=None,
        metavar="MS",
        help="the modelled FFN per (layer, stage), ms (12; shorter ones leave a 2-CPU host behind)",
    )
    bench.add_argument(
        "--rank-cores",
        dest="rank_cores",
        type=int,
        default=None,
        metavar="N",
        help="give each FFN rank's emulated device N vector cores: CAM 8, MC2's dispatch and combine the rest "
        "(compute-side fits exactly; the layer's core rule sees the count)",
    )
    bench.add_argument(
        "--trace",
        metavar="PATH",
        help="write one traced step per policy as Chrome trace-event JSON (Perfetto, chrome://tracing): "
        "one process per policy, one track per stream (C, K0, K1, ...)",
    )
    bench.add_argument(
        "--plot", metavar="PATH", help="write a PNG: timeline of one step per policy and per-layer time (matplotlib)"
    )
    bench.add_argument(
        "--graph",
        action="store_true",
        default=None,
        help="upstream's decode graph path (--device cuda: CUDA graphs; --device cpu: the emulated device's): "
        "capture each policy's step once, all in the runner's one graph pool (its layer config applied, "
        "VLLM_CAMP2P_MULTISTREAM_GRAPH on; adaptive overlap with both variants, GRAPH=adaptive, its layer kept "
        "applied while the replays run) and time replays, round-robin, each compared bitwise with the eager "
        "serial step; reports each capture's time and device memory (cuda)",
    )
    bench.add_argument(
        "--device-world",
        action="store_true",
        default=None,
        help="--device cpu: run the device world (static attention buffers filled before each step or replay, "
        "results read from static buffers after it, the attention peer as device work) on the emulated device, "
        "the code path of --device cuda on the CPU (default: the host world)",
    )
    bench.add_argument(
        "--profile-trace",
        metavar="PATH",
        help="--device cuda|npu: profile one overlapped step (torch.profiler / torch_npu.profiler), check its edges "
        "on the device kernel times, and write its per-stream kernel timelines as Chrome trace JSON",
    )

    from camp2p_overlap.tools.bench.sweep import (
        DEFAULT_COMM_CORES,
        DEFAULT_RATIOS,
        DEFAULT_STAGE_COUNTS,
        DEFAULT_STAGE_RATIO,
        DEFAULT_WORK_HIDDEN,
        DEFAULT_WORK_TOKENS,
        SWEEP_DEFAULTS,
    )

    sweep = sub.add_parser(
        "sweep",
        help="per-layer time against communication/FFN ratio, the number of stages and the work size",
        description="Run the benchmark over a range of communication/FFN-compute ratios (set through the "
        "modeled link bandwidth, after measuring f once), over 1, 2 and 3 stages, over the cores each "
        "communication op keeps busy (--comm-cores), and over the tokens per "
        "stage (serial, adaptive overlap and both layouts fixed side by side, with the preset's link). Base "
        "world: the "
        "ffn-bound scenario unless --scenario says otherwise, with "
        + ", ".join(f"--{k} {v}" for k, v in SWEEP_DEFAULTS.items())
        + "; explicit flags override. Each point sets the modeled link bandwidth itself (--link-gbps is "
        "ignored; --link-latency-us caps each op's latency at 10%% of the target communication time).",
        epilog="Absolute CPU times say nothing about an NPU; only the ratios carry over.",
    )
    _add_world_flags(sweep, {**SCENARIOS["ffn-bound"], **SWEEP_DEFAULTS})
    sweep.add_argument(
        "--ratios",
        type=_floats,
        default=DEFAULT_RATIOS,
        help=f"target (a+e)/f values (default {','.join(f'{r:g}' for r in DEFAULT_RATIOS)})",
    )
    sweep.add_argument(
        "--stage-counts",
        type=_ints,
        default=DEFAULT_STAGE_COUNTS,
        help=f"stage counts to run (default {','.join(map(str, DEFAULT_STAGE_COUNTS))})",
    )
    sweep.add_argument(
        "--stage-ratio",
        type=float,
        default=DEFAULT_STAGE_RATIO,
        help=f"target (a+e)/f for the stage-count runs (default {DEFAULT_STAGE_RATIO:g})",
    )
    sweep.add_argument(
        "--work-tokens",
        type=_ints_or_none,
        default=DEFAULT_WORK_TOKENS,
        help="tokens per stage of the work-size points; 'none' skips them "
        f"(default {','.join(map(str, DEFAULT_WORK_TOKENS))})",
    )
    sweep.add_argument(
        "--work-hidden",
        type=_ints_or_none,
        default=DEFAULT_WORK_HIDDEN,
        help=f"MoE hidden sizes of the work-size points (default {','.join(map(str, DEFAULT_WORK_HIDDEN))})",
    )
    sweep.add_argument(
        "--comm-core-points",
        type=_ints_or_zero,
        default=None,
        help="--comm-cores values of the contention points, at the stage ratio; on cuda each is capped at "
        "(SMs - 1) // stages, what the GPU holds with every stage's op in flight (a capped point that another "
        "point already covers is dropped; the JSON's comm_core_changes says which); 'none' skips them (default "
        + "; ".join(f"{dev}: {','.join(map(str, v)) or 'none'}" for dev, v in DEFAULT_COMM_CORES.items())
        + ")",
    )
    sweep.add_argument(
        "--graph",
        dest="work_graph",
        action="store_true",
        help="measure every work-size point in graph mode too (bench --graph: captured steps replayed; serial, "
        "overlap with both variants and each fixed layout; on --device cpu comm-side is not captured: the "
        "emulated NPU refuses comm on side streams), reported next to the eager one",
    )
    sweep.add_argument("--md", metavar="PATH", help="write the tables as Markdown")
    sweep.add_argument("--plot", metavar="PATH", help="write a PNG of per-layer time against ratio and stages")
    sweep.add_argument(
        "--json",
        metavar="PATH",
        help='write every point\'s full report as JSON, as the sweep goes ("partial": true after the calibration '
        "and after each point), then the final one",
    )

    overhead = sub.add_parser(
        "overhead",
        help="host cost of the project's own code per (layer, stage), per pass-through step and per wrapped "
        "call, and a decided-serial step against no layer",
        description="Time the wrappers, gate, adaptive bookkeeping, session and device backend alone: the "
        "stand-in runner's loop over a no-op transport, a no-op FFN and a device module whose streams and "
        "events do nothing. Per shape and round, blocks of unpatched, engaged (overlap on every step) and "
        "pass-through (applied, adaptive engage decided for serial) steps run in a rotating order; each "
        "timed step minus the round's median unpatched step, per (layer, stage), per step or per wrapped call, "
        "is one sample. Then the decided-serial A/B on the emulated world of the sweep's smallest work point: "
        "two identical copies of the stand-ins, one unpatched and one applied and decided serial, timed in pairs "
        "of one step each, alternating which runs first; each pair gives the extra step time in %. An A/A "
        "control of the same pairs with both copies unpatched, run first, measures the method's own bias. "
        "Per shape, the watchdog's cost: pairs of blocks of engaged steps with it at its default and off. "
        "Prints medians and p90s; --json schema: docs/benchmark.md.",
    )
    overhead.add_argument("--layers", type=_ints, default=OverheadParams.layers, help="layer counts (default 4,16,61)")
    overhead.add_argument("--stages", type=_ints, default=OverheadParams.stages, help="stage counts (default 1,2,3)")
    overhead.add_argument(
        "--steps", type=int, default=OverheadParams.steps, help="timed steps per block (default %(default)s)"
    )
    overhead.add_argument(
        "--rounds", type=int, default=OverheadParams.rounds, help="rounds per shape (default %(default)s)"
    )
    overhead.add_argument(
        "--delay-us",
        type=float,
        default=0.0,
        help="busy wait added to every no-op receive: a cost outside our code, which must cancel out",
    )
    overhead.add_argument(
        "--ab-pairs",
        type=int,
        default=OverheadParams.ab_pairs,
        help="timed pairs of steps of the decided-serial A/B and of its A/A control each; 0 skips both "
        "(default %(default)s)",
    )
    overhead.add_argument(
        "--pt-pairs",
        type=int,
        default=OverheadParams.pt_pairs,
        help="timed pairs per shape of the paired pass-through figure (a wrapped step and upstream's own "
        "function on the same runner, alternating which runs first) and of its A/A control; 0 skips it "
        "(default %(default)s)",
    )
    overhead.add_argument(
        "--wd-pairs",
        type=int,
        default=OverheadParams.wd_pairs,
        help="timed pairs per shape of the watchdog's figure (a block of engaged steps with the watchdog at its "
        "default and one with it off, alternating which runs first); 0 skips it (default %(default)s)",
    )
    overhead.add_argument("--json", metavar="PATH", help="write the result as JSON")

    doctor = sub.add_parser(
        "doctor",
        help="check a deployment box: versions, patch targets, backend, switches",
        description="Report installed versions (vLLM, torch, torch_npu, wrapt, afd-plugin, vLLM-Ascend; from\n"
        "distribution metadata), which supported stack they fit and why, the vLLM version gate, every\n"
        "patch target of the stack's manifest (its module is imported: importable? defined where the\n"
        "manifest says? same signature?), the stream backend that would be used with this box's device,\n"
        "and every VLLM_CAMP2P_* switch as set and as parsed.",
        epilog=DOCTOR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument(
        "--stack",
        default=None,
        help="manifest stack to check, e.g. vllm-0.26.0 (default: the shipped stack the installed versions fit)",
    )
    doctor.add_argument(
        "--config",
        dest="deployment",
        default=None,
        metavar="FILE|JSON",
        help="the deployment's vLLM config (YAML/JSON file given to vllm serve --config) or a JSON string: "
        "report the AFD connector, num_ubatches, stage->HCCL group map, aiv_num/ffn_core_num",
    )

    docs = sub.add_parser(
        "docs",
        help="regenerate the docs' generated blocks (figures, configuration table) from docs/results/",
        description="Rewrite every generated block (between '<!-- BEGIN generated: NAME -->' and "
        "'<!-- END generated: NAME -->') of README.md and docs/benchmark.md from the JSON reports in "
        "docs/results/ (bench.json, sweep.json, overhead.json, written by the tools' --json options, each "
        "recording its run; runs.json for a report that does not) and the table of environment variables; "
        "every figure block names its run (command, commit, machine, date). Text outside the blocks is left alone.",
    )
    docs.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each block that would change")
    docs.add_argument("--root", default=".", metavar="DIR", help="the checkout (default: the current directory)")
    return parser


def _explicit(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in fields(BenchParams)} - {"scenario"}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def _fail(message: str, code: int = 2) -> int:
    print(f"camp2p-overlap: error: {message}", file=sys.stderr)
    return code


def _device_check(device: str) -> str | None:
    if device == "cpu":
        return None
    from camp2p_overlap.emulation.kernel_world import DeviceUnavailable, require_device

    try:
        require_device(device)
    except DeviceUnavailable as exc:
        return str(exc)
    return None


def _preflight(device: str, plot: str | None) -> str | None:
    """Why the run cannot start (device missing, matplotlib missing for
    ``--plot``), checked before any work is done; None when it can."""
    why = _device_check(device)
    if why or not plot:
        return why
    from camp2p_overlap.tools.bench.plot import PlotUnavailable, _figure

    try:
        _figure(1, 1)
    except PlotUnavailable as exc:
        return str(exc)
    return None


def _rank_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from camp2p_overlap.tools.bench.ranks import RankBenchParams, rank_bench_table, run_rank_bench
    from camp2p_overlap.tools.bench.tables import write_json
    from camp2p_overlap.tools.provenance import report_env, run_record

    chosen = {
        "ffn_ranks": args.ffn_ranks,
        "attn_ranks": args.attn_ranks if args.attn_ranks is not None else args.ffn_ranks,
        "steps": args.rank_steps,
        "reps": args.rank_reps,
        "ffn_ms": args.rank_ffn_ms,
        "vector_cores": args.rank_cores,
    }
    try:
        params = RankBenchParams(**{k: v for k, v in chosen.items() if v is not None})
        params.spec(0, straggler=True)  # the world's own checks (the mapping, the rank counts)
    except (TypeError, ValueError) as exc:
        return _fail(str(exc))
    if params.steps < 2 * params.warmup or params.reps < 1 or not params.ffn_ms > 0:
        return _fail(f"--rank-steps must be at least {2 * params.warmup}, --rank-reps at least 1, --rank-ffn-ms > 0")
    say = None if args.no_progress else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        report = run_rank_bench(params, progress=say)
    except RuntimeError as exc:
        return _fail(str(exc))
    report["run"] = run_record(argv)
    report["env"] = report_env()
    print(rank_bench_table(report))
    if args.json:
        write_json(args.json, report)
    return 0 if all(s["outputs_equal"] and s["parted_steps"] == 0 for s in report["summary"].values()) else 1


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.ffn_ranks is not None:
        return _rank_bench(args, argv)
    from camp2p_overlap.tools.bench.runner import resolve_params, run_bench
    from camp2p_overlap.tools.bench.tables import bench_table, problems, write_json, write_outputs
    from camp2p_overlap.tools.provenance import run_record

    try:
        params = resolve_params(_explicit(args), args.scenario)
    except ValueError as exc:
        return _fail(str(exc))
    if args.profile_trace and params.device == "cpu":
        from camp2p_overlap.tools.bench.runner import PROFILE_NEEDS_DEVICE

        return _fail(PROFILE_NEEDS_DEVICE)
    why = _preflight(params.device, args.plot)
    if why:
        return _fail(why)
    from camp2p_overlap.emulation.kernel_world import DeviceUnavailable

    record = run_record(argv)  # how the report was made (docs/benchmark.md, "Where the figures come from")
    on_report = None
    if args.json:
        json_path = args.json

        def on_report(partial: dict[str, Any]) -> None:  # what a run cut short leaves
            write_json(json_path, {**partial, "run": record})

    try:
        run = run_bench(params, progress=not args.no_progress, profile_trace=args.profile_trace, on_report=on_report)
    except DeviceUnavailable as exc:
        return _fail(str(exc))
    run.report["run"] = record
    print(bench_table(run.report))
    prof = run.report.get("profile")
    if prof is not None:
        state = "held" if prof["edges_ok"] else "FAILED: " + "; ".join(prof["edge_violations"][:3])
        print(f"profiled step: {prof['ops']} ops on streams {prof['streams']}; device-time edges {state}")
    write_outputs(run, json_path=args.json, trace_path=args.trace)
    if args.plot:
        from camp2p_overlap.tools.bench.plot import bench_plot

        bench_plot(run.timelines, run.report, args.plot)
    for what, path in (
        ("JSON", args.json),
        ("trace", args.trace),
        ("plot", args.plot),
        ("profile trace", args.profile_trace),
    ):
        if path:
            print(f"{what}: {path}")
    return 1 if problems(run.report) else 0


def _sweep(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from camp2p_overlap.tools.bench.runner import resolve_params
    from camp2p_overlap.tools.bench.sweep import SWEEP_DEFAULTS, sweep_markdown
    from camp2p_overlap.tools.bench.tables import problems, write_json
    from camp2p_overlap.tools.provenance import run_record

    record = run_record(argv)
    scenario = args.scenario or "ffn-bound"
    try:
        params = resolve_params({**SWEEP_DEFAULTS, **_explicit(args)}, scenario)
        params = replace(params, comm_ratio=None)  # each point sets its own link (or keeps the preset's)
        for s in args.stage_counts:
            if not 1 <= s <= 3:
                raise ValueError(f"--stage-counts: {s} is out of range 1..3")
        for n in args.comm_core_points or ():
            replace(params, comm_cores=n).validate()
        if any(r <= 0 for r in args.ratios) or args.stage_ratio <= 0:
            raise ValueError("ratios must be positive")
        if args.work_graph:
            replace(params, graph=True).validate()  # what the graph work points will run
    except ValueError as exc:
        return _fail(str(exc))
    why = _preflight(params.device, args.plot)
    if why:
        return _fail(why)
    from camp2p_overlap.emulation.kernel_world import DeviceUnavailable

    try:
        result = _run_sweep(args, params, record)
    except DeviceUnavailable as exc:
        return _fail(str(exc))
    result["run"] = record
    text = sweep_markdown(result, record["command"])
    print(text)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"Markdown: {args.md}")
    if args.json:
        write_json(args.json, result)
        print(f"JSON: {args.json}")
    if args.plot:
        from camp2p_overlap.tools.bench.plot import sweep_plot

        sweep_plot(result, args.plot)
        print(f"plot: {args.plot}")
    points = result["ratio_points"] + result["stage_points"] + result["comm_core_points"] + result["work_points"]
    reports = [pt["report"] for pt in points] + [pt["graph_report"] for pt in points if "graph_report" in pt]
    failed = [p for r in reports for p in problems(r)]
    for p in failed:
        print(f"FAILED: {p}")
    return 1 if failed else 0


def _overhead(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from camp2p_overlap.tools.bench.tables import write_json
    from camp2p_overlap.tools.overhead import format_overhead, measure_overhead
    from camp2p_overlap.tools.provenance import run_record

    params = OverheadParams(
        layers=tuple(args.layers),
        stages=tuple(args.stages),
        steps=args.steps,
        rounds=args.rounds,
        delay_us=args.delay_us,
        ab_pairs=args.ab_pairs,
        pt_pairs=args.pt_pairs,
        wd_pairs=args.wd_pairs,
    )
    try:
        params.validate()
    except ValueError as exc:
        return _fail(str(exc))
    record = run_record(argv)
    result = {**measure_overhead(params), "run": record}
    print(format_overhead(result))
    if args.json:
        write_json(args.json, result)
        print(f"JSON: {args.json}")
    return 0


def _run_sweep(args: argparse.Namespace, params: Any, record: dict[str, Any]) -> dict[str, Any]:
    from camp2p_overlap.tools.bench.sweep import run_sweep
    from camp2p_overlap.tools.bench.tables import write_json

    on_result = None
    if args.json:
        json_path = args.json

        def on_result(partial: dict[str, Any]) -> None:  # what a sweep cut short leaves
            write_json(json_path, {**partial, "run": record})

    return run_sweep(
        params,
        ratios=args.ratios,
        stage_counts=args.stage_counts,
        stage_ratio=args.stage_ratio,
        work_tokens=args.work_tokens,
        work_hidden=args.work_hidden,
        comm_cores=args.comm_core_points,
        work_graph=args.work_graph,
        progress=not args.no_progress,
        on_result=on_result,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command in ("bench", "sweep", "overhead"):
        from camp2p_overlap.tools.bench.runner import use_tool_switch_interval

        use_tool_switch_interval()  # these tools' processes only (docs/benchmark.md, "Thread switching")
    if args.command == "bench":
        return _bench(args, argv)
    if args.command == "sweep":
        return _sweep(args, argv)
    if args.command == "overhead":
        return _overhead(args, argv)
    if args.command == "docs":
        from pathlib import Path

        from camp2p_overlap.tools.docgen import run_docs

        return run_docs(Path(args.root), check=args.check)
    from camp2p_overlap.tools.doctor import main_doctor

    return main_doctor(as_json=args.json, stack=args.stack, deployment=args.deployment)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
