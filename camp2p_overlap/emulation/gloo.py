"""The FFN runner and its attention peer as two processes talking over
``torch.distributed`` point-to-point (gloo, loopback only).

* Rank 0, the attention process, plays every stage's attention rank: per
  step it sends the step's schedule (stage ids, token counts) over the
  default group (as afd-plugin's Gloo control plane does), then, on one
  thread per stage, for each layer sends the hidden states and receives the
  FFN output, computing the next layer's hidden states from what it got
  (the data dependency of the real model, as in ``EmulatedTransport``).
* Rank 1, the FFN process, is patched through the real entry-point path:
  with ``VLLM_CAMP2P_MULTISTREAM=1`` it calls vLLM's plugin loader
  (``vllm.plugins.load_general_plugins()``) when vLLM is importable, else
  ``camp2p_overlap.core.plugin.register()`` as that loader would; then it
  imports the stand-in runner and connector (the post-import hooks wrap
  them) and runs ``execute_ffn_step`` per step. Its connector's transport
  receives (A2E) with ``dist.recv`` from rank 0 and sends (E2A) with
  ``dist.send`` to it.

One process group per stage (``dist.new_group(backend="gloo")``), as
CAMP2P has one HCCL group per stage: with the overlap engaged each stage's
ops run on that stage's side-stream thread, different stages concurrently,
and each thread only ever touches its own group. Messages are tagged per
(layer, stage, kind).

The run has two phases in the same pair of processes: ``overlap`` (the
patch applied by the entry point) and ``serial`` (the FFN process calls
``camp2p_overlap.unpatch()`` first), with the same steps; the attention
process compares what it received in both, bitwise.

    python -m camp2p_overlap.emulation.gloo --out DIR      # runs both ranks
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from camp2p_overlap.emulation.device import launch
from camp2p_overlap.emulation.device import synchronize as device_synchronize

CMD_STOP, CMD_STEP, CMD_SERIAL = 0, 1, 2
MAX_STAGES = 3
KIND_HIDDEN, KIND_ROUTED, KIND_SHARED = 0, 1, 2
STEP_SCHEDULES = [(0, 1), (0, 1, 2), (0, 2), (1, 2), (0, 1, 2), (1,)]


def tag(layer: int, stage: int, kind: int) -> int:
    """The p2p tag of one message: unique per (layer, stage, kind)."""
    return ((layer * MAX_STAGES + stage) * 4 + kind) + 16


@dataclass(frozen=True)
class PairSpec:
    port: int
    layers: int = 3
    steps: int = 6
    hidden: int = 32
    max_tokens: int = 12
    shared_expert: bool = True
    seed: int = 0
    timeout_s: float = 60.0
    #: 1: every stage on the default group instead of one group per stage
    #: (to check gloo p2p from several threads on one group).
    one_group: int = 0

    def schedule(self, step: int) -> dict[int, int]:
        """Stage id -> token count of step ``step`` (both ranks compute it)."""
        stages = STEP_SCHEDULES[step % len(STEP_SCHEDULES)]
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        return {s: int(torch.randint(1, self.max_tokens + 1, (1,), generator=g)) for s in stages}


def _init(spec: PairSpec, rank: int) -> list[Any]:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank, world_size=2, timeout=timeout
    )
    if spec.one_group:
        return [None] * MAX_STAGES  # the default group for every stage
    # One group per stage, created in the same order on both ranks.
    return [dist.new_group([0, 1], backend="gloo", timeout=timeout) for _ in range(MAX_STAGES)]


# ---------------------------------------------------------------------------
# rank 0: attention
def _header(cmd: int, step: int = 0, sched: dict[int, int] | None = None) -> torch.Tensor:
    h = torch.full((2 + 2 * MAX_STAGES,), -1, dtype=torch.int64)
    h[0], h[1] = cmd, step
    for i, (s, n) in enumerate(sorted((sched or {}).items())):
        h[2 + i], h[2 + MAX_STAGES + i] = s, n
    return h


def attention_main(spec: PairSpec, out: Path) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    groups = _init(spec, 0)
    from camp2p_overlap.emulation.world import AttentionInputs

    inputs = AttentionInputs(hidden=spec.hidden, max_tokens=spec.max_tokens, seed=spec.seed)
    got: dict[str, dict[tuple[int, int, int], torch.Tensor]] = {"overlap": {}, "serial": {}}
    errors: list[str] = []

    def peer(phase: str, step: int, stage: int, n: int) -> None:
        try:
            last = None
            for layer in range(spec.layers):
                hidden = inputs.hidden(step, layer, n, last)
                dist.send(hidden.contiguous(), dst=1, group=groups[stage], tag=tag(layer, stage, KIND_HIDDEN))
                routed = torch.empty(n, spec.hidden)
                dist.recv(routed, src=1, group=groups[stage], tag=tag(layer, stage, KIND_ROUTED))
                outp = routed
                if spec.shared_expert:
                    shared = torch.empty(n, spec.hidden)
                    dist.recv(shared, src=1, group=groups[stage], tag=tag(layer, stage, KIND_SHARED))
                    outp = routed + shared
                got[phase][(step, layer, stage)] = outp
                last = outp
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            errors.append(f"{phase} step {step} stage {stage}: {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    for phase in ("overlap", "serial"):
        if phase == "serial":
            dist.send(_header(CMD_SERIAL), dst=1, tag=1)
        for step in range(spec.steps):
            sched = spec.schedule(step)
            dist.send(_header(CMD_STEP, step, sched), dst=1, tag=1)
            threads = [
                threading.Thread(target=peer, args=(phase, step, s, n), name=f"attention-peer-s{s}", daemon=True)
                for s, n in sched.items()
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(spec.timeout_s)
                if t.is_alive():
                    errors.append(f"{phase} step {step}: {t.name} did not finish in {spec.timeout_s} s")
            if errors:
                break
        if errors:
            break
    dist.send(_header(CMD_STOP), dst=1, tag=1)
    seconds = time.perf_counter() - t0
    ov, se = got["overlap"], got["serial"]
    mismatched = sorted(str(k) for k in ov.keys() & se.keys() if not torch.equal(ov[k], se[k]))
    summary = {
        "role": "attention",
        "pid": os.getpid(),
        "errors": errors,
        "messages": {k: len(v) for k, v in got.items()},
        "same_keys": ov.keys() == se.keys(),
        "mismatched": mismatched,
        "equal": not errors and ov.keys() == se.keys() and bool(ov) and not mismatched,
        "seconds": round(seconds, 3),
    }
    (out / "attention.json").write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()
    return 0 if summary["equal"] else 1


# ---------------------------------------------------------------------------
# rank 1: FFN
class GlooTransport:
    """The ``a2e``/``e2a`` custom ops of the stand-in connector, as gloo
    point-to-point with the attention rank on the stage's group: each op
    allocates its buffers and launches its transfer as a kernel of the
    emulated device's current stream (a stream's worker thread runs it)."""

    def __init__(self, groups: list[Any], hidden: int) -> None:
        self.groups = groups
        self.hidden = hidden
        self.lock = threading.Lock()
        #: (kind, stage) -> thread names the op ran on.
        self.threads: dict[str, set[str]] = {}

    def _note(self, kind: str, stage: int) -> None:
        with self.lock:
            self.threads.setdefault(f"{kind} s{stage}", set()).add(threading.current_thread().name)

    def a2e(
        self, *, group: str, stage: int, layer: int, num_tokens: int, max_num_tokens: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        n = int(num_tokens)
        hidden = torch.empty(n, self.hidden)
        g = self.groups[stage]

        def kernel() -> None:  # on the current stream of the emulated device
            self._note("a2e", stage)
            dist.recv(hidden, src=0, group=g, tag=tag(layer, stage, KIND_HIDDEN))

        launch(kernel, writes=(hidden,))
        return hidden, torch.tensor([n])

    def e2a(
        self,
        *,
        group: str,
        stage: int,
        layer: int,
        routed: torch.Tensor,
        shared: torch.Tensor | None,
        atten_batch_size: torch.Tensor,
    ) -> None:
        import torch.distributed as dist

        g = self.groups[stage]

        def kernel() -> None:  # reads the FFN output once its stream reaches it
            self._note("e2a", stage)
            if int(atten_batch_size[0]) != routed.shape[0]:
                raise RuntimeError(f"stage {stage}: e2a batch size does not match its a2e")
            dist.send(routed.contiguous(), dst=0, group=g, tag=tag(layer, stage, KIND_ROUTED))
            if shared is not None:
                dist.send(shared.contiguous(), dst=0, group=g, tag=tag(layer, stage, KIND_SHARED))

        launch(kernel)


def load_plugins_like_vllm() -> str:
    """What vLLM does in each of its processes: load the general plugins
    (this process's ``VLLM_PLUGINS`` limits them to ours). Without vLLM,
    call our entry point the way that loader would."""
    try:
        import vllm.plugins as vp
    except Exception:  # noqa: BLE001 - no usable vLLM here
        from camp2p_overlap.core import plugin

        plugin.register()
        return "camp2p_overlap.core.plugin.register()"
    vp.load_general_plugins()
    return "vllm.plugins.load_general_plugins()"


def declare_ffn_ep_group(ranks: list[int]) -> None:
    """Set vLLM's expert-parallel group of this FFN process to ``ranks`` (global ranks), as vLLM's parallel state
    holds it on an FFN server. Here the default world is the attention rank and the FFN rank together (one pair),
    which no AFD deployment has: the FFN side's world is its own. The layer reads the FFN ranks from this group
    (docs/design.md, "Many FFN ranks"), so it sees one FFN rank, as it is."""
    import types

    try:
        import vllm.distributed.parallel_state as parallel_state
    except Exception:  # noqa: BLE001 - no usable vLLM here: the name the layer reads, and only it
        parallel_state = types.ModuleType("vllm.distributed.parallel_state")
        sys.modules["vllm.distributed.parallel_state"] = parallel_state
    parallel_state._EP = types.SimpleNamespace(ranks=list(ranks))  # type: ignore[attr-defined]


def ffn_main(spec: PairSpec, out: Path) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    how = load_plugins_like_vllm()
    import camp2p_overlap
    from camp2p_overlap.core.observe.trace import recording
    from camp2p_overlap.emulation import standins
    from camp2p_overlap.emulation.moe import MoEFFN, MoEShape
    from camp2p_overlap.emulation.world import AfdConfig, EmulatedModel, HFConfig, ModelConfig, StageMeta

    applied_at_start = camp2p_overlap.is_applied()
    standins.install(standins.REAL_ROOT)
    runner_mod, conn_mod, meta_mod = standins.import_standins(standins.REAL_ROOT)
    report = camp2p_overlap.status()
    groups = _init(spec, 1)
    declare_ffn_ep_group([1])
    transport = GlooTransport(groups, spec.hidden)
    shape = MoEShape(hidden=spec.hidden, ffn=2 * spec.hidden, experts=4, top_k=2, shared_expert=spec.shared_expert)
    connector = conn_mod.CAMP2pAFDConnector(transport, hidden_size=spec.hidden)
    runner = runner_mod.AFDNPUFFNModelRunner(
        connector=connector,
        model=EmulatedModel(
            MoEFFN(shape, seed=spec.seed), return_payload=True, payload_cls=meta_mod.AFDF2ATransferPayload
        ),
        num_layers=spec.layers,
        max_num_tokens=spec.max_tokens,
        afd_config=AfdConfig(),
        device=torch.device("cpu"),
        model_config=ModelConfig(HFConfig()),
    )
    phase = "overlap"
    steps: list[dict[str, Any]] = []
    threads: dict[str, dict[str, list[str]]] = {}
    unpatched = None
    error = None
    try:
        while True:
            h = torch.empty(2 + 2 * MAX_STAGES, dtype=torch.int64)
            dist.recv(h, src=0, tag=1)
            cmd = int(h[0])
            if cmd == CMD_STOP:
                break
            if cmd == CMD_SERIAL:
                threads[phase] = {k: sorted(v) for k, v in transport.threads.items()}
                transport.threads = {}
                unpatched = camp2p_overlap.unpatch(timeout=spec.timeout_s)
                phase = "serial"
                continue
            sched = {int(h[2 + i]): int(h[2 + MAX_STAGES + i]) for i in range(MAX_STAGES) if int(h[2 + i]) >= 0}
            dp = {s: StageMeta(n) for s, n in sched.items()}
            with recording() as rec:
                runner.execute_ffn_step(dp_metadata_list=dp)
                device_synchronize()  # the step's kernels ran (the recv/send with attention)
            streams = sorted({o.stream for o in rec.ops() if o.kind in ("a2e", "e2a")})
            steps.append({"phase": phase, "step": int(h[1]), "stages": sorted(sched), "comm_streams": streams})
        threads[phase] = {k: sorted(v) for k, v in transport.threads.items()}
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    summary = {
        "role": "ffn",
        "pid": os.getpid(),
        "plugins_loaded_by": how,
        "applied_by_entry_point": applied_at_start,
        "report": report.to_dict(),
        "steps": steps,
        "threads": threads,
        "unpatched": unpatched,
        "stream_threads_left": [t.name for t in threading.enumerate() if t.name.startswith("camp2p-overlap-stream")],
        "error": error,
    }
    (out / "ffn.json").write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()
    return 0 if error is None else 1


# ---------------------------------------------------------------------------
# launcher
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PairResult:
    attention: dict[str, Any] | None
    ffn: dict[str, Any] | None
    returncodes: tuple[int | None, int | None]
    logs: tuple[str, str]
    timed_out: bool


def run_pair(
    spec_kw: dict[str, Any], out: Path, *, timeout_s: float = 120.0, extra_env: dict | None = None
) -> PairResult:
    """Start both ranks as fresh processes on a free loopback port; wait at
    most ``timeout_s``; kill both on a timeout."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P")}
    base_env.update(
        {
            "GLOO_SOCKET_IFNAME": "lo",  # loopback only
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
    )
    ffn_env = dict(base_env)
    ffn_env.update(
        {
            "VLLM_CAMP2P_MULTISTREAM": "1",
            "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cpu",
            # Every multi-stage step overlapped: the pair checks that path
            # across processes (adaptive engage would mix in serial steps).
            "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE": "0",
            "VLLM_PLUGINS": "camp2p_overlap",
        }
    )
    ffn_env.update(extra_env or {})
    args = [f"--{k.replace('_', '-')}={v}" for k, v in spec_kw.items()]
    procs = []
    logs = []
    for role, env in (("attention", base_env), ("ffn", ffn_env)):
        log = open(out / f"{role}.log", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "camp2p_overlap.emulation.gloo",
                    "--role",
                    role,
                    "--port",
                    str(port),
                    "--out",
                    str(out),
                    *args,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for log in logs:
        log.close()

    def load(name: str) -> dict[str, Any] | None:
        f = out / f"{name}.json"
        return json.loads(f.read_text()) if f.exists() else None

    texts = tuple((out / f"{r}.log").read_text(errors="replace") for r in ("attention", "ffn"))
    return PairResult(load("attention"), load("ffn"), (procs[0].returncode, procs[1].returncode), texts, timed_out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="camp2p-overlap: FFN and attention over gloo p2p, two processes")
    ap.add_argument("--role", choices=["attention", "ffn", "both"], default="both")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    for f in ("layers", "steps", "hidden", "max_tokens", "seed", "one_group"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(PairSpec, f))
    ap.add_argument("--timeout-s", type=float, default=PairSpec.timeout_s)
    ap.add_argument("--shared-expert", type=int, choices=[0, 1], default=1)
    a = ap.parse_args(argv)
    kw = {
        "layers": a.layers,
        "steps": a.steps,
        "hidden": a.hidden,
        "max_tokens": a.max_tokens,
        "seed": a.seed,
        "one_group": a.one_group,
        "timeout_s": a.timeout_s,
        "shared_expert": int(a.shared_expert),
    }
    if a.role == "both":
        res = run_pair(kw, a.out, timeout_s=4 * a.timeout_s)
        print(json.dumps({"attention": res.attention, "ffn": res.ffn, "returncodes": res.returncodes}, indent=1))
        return 0 if res.returncodes == (0, 0) else 1
    spec = PairSpec(port=a.port, **{**kw, "shared_expert": bool(a.shared_expert)})
    return attention_main(spec, a.out) if a.role == "attention" else ffn_main(spec, a.out)


if __name__ == "__main__":
    sys.exit(main())
