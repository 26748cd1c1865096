"""The processes of the multi-rank world (:mod:`camp2p_overlap.emulation.ranks`):
an attention rank and an FFN rank, each run as
``python -m camp2p_overlap.emulation.ranks_roles --role ... --rank N``.

Groups, per process:

* the default world: the A attention ranks (attention) or the F FFN ranks
  (FFN: the group of the MoE collectives, and of anything the patch layer
  exchanges over its c10d store);
* attention only: one TP group per stage (``dist.new_group``), so each stage
  thread all-reduces on its own group;
* per FFN rank f, built without a default group (``ProcessGroupGloo`` over
  ``PrefixStore("afd/f{f}/...", store)`` of attention rank 0's ``TCPStore``):
  a control group (the step's schedule) and one group per stage, each of
  FFN rank f (group rank 0) and its attention peers (group ranks 1..k).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation.device import hold, hold_until, kernel_start_ns, launch
from camp2p_overlap.emulation.ranks import CAPTURE, MAX_STAGES, STEP, WARMUP, Ports, RanksSpec

CMD_STOP, CMD_RUN, CMD_SERIAL = 0, 1, 2
KINDS = (STEP, WARMUP, CAPTURE)
KIND_HIDDEN, KIND_ROUTED, KIND_SHARED = 0, 1, 2
HEADER = 4 + 2 * MAX_STAGES
CTRL_TAG = 1


def tag(layer: int, stage: int, kind: int) -> int:
    """The p2p tag of one message: unique per (layer, stage, kind)."""
    return ((layer * MAX_STAGES + stage) * 4 + kind) + 16


def _timeout(spec: RanksSpec) -> datetime.timedelta:
    return datetime.timedelta(seconds=spec.timeout_s)


def _init_world(spec: RanksSpec, port: int, rank: int, size: int) -> None:
    """This process's default world (gloo on loopback): its side's ranks only, as each side of AFD has its own."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=_timeout(spec)
    )


def _store(spec: RanksSpec, ports: Ports, *, host: bool) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", ports.store, None, host, timeout=_timeout(spec), wait_for_workers=False)


def afd_groups(spec: RanksSpec, store: Any, ffn_rank: int, group_rank: int) -> tuple[Any, list[Any]]:
    """FFN rank ``ffn_rank``'s control group and per-stage groups, made in
    the same order by each member (``group_rank`` 0: the FFN rank)."""
    import torch.distributed as dist

    size = spec.peers_per_ffn + 1

    def make(name: str) -> Any:
        return dist.ProcessGroupGloo(
            dist.PrefixStore(f"afd/f{ffn_rank}/{name}", store), group_rank, size, _timeout(spec)
        )

    ctrl = make("ctrl")
    return ctrl, [make(f"s{s}") for s in range(spec.stages)]


def _header(cmd: int, entry: int = 0, step: int = 0, kind: str = STEP, sched: dict[int, int] | None = None):
    h = torch.full((HEADER,), -1, dtype=torch.int64)
    h[0], h[1], h[2], h[3] = cmd, entry, step, KINDS.index(kind)
    for i, (s, n) in enumerate(sorted((sched or {}).items())):
        h[4 + i], h[4 + MAX_STAGES + i] = s, n
    return h


# ---------------------------------------------------------------------------
# attention
class AttentionRank:
    def __init__(self, spec: RanksSpec, rank: int, ports: Ports) -> None:
        import torch.distributed as dist

        from camp2p_overlap.emulation.world import AttentionInputs

        self.spec, self.rank = spec, rank
        _init_world(spec, ports.attn, rank, spec.attn_ranks)  # the attention instance's own world
        ranks = list(range(spec.attn_ranks))
        self.tp = [dist.new_group(ranks, backend="gloo", timeout=_timeout(spec)) for _ in range(spec.stages)]
        self.store = _store(spec, ports, host=rank == 0)
        self.ffn = spec.ffn_of(rank)
        self.ctrl, self.afd = afd_groups(spec, self.store, self.ffn, 1 + spec.peers_of(self.ffn).index(rank))
        self.inputs = AttentionInputs(hidden=spec.hidden, max_tokens=spec.tokens, seed=spec.seed + 101 * rank)
        self.got: dict[str, dict[tuple[int, int, int], torch.Tensor]] = {"overlap": {}, "serial": {}}
        self.errors: list[str] = []

    def send_header(self, h: torch.Tensor) -> None:
        self.ctrl.send([h], 0, CTRL_TAG).wait()

    def peer(self, phase: str, entry: int, step: int, stage: int, n: int) -> None:
        """One stage of one step: per layer A2E, E2A, the TP all-reduce, and
        the next layer's input from the all-reduced result."""
        import torch.distributed as dist

        h = self.spec.hidden
        pg = self.afd[stage]
        try:
            last = None
            for layer in range(self.spec.layers):
                hidden = self.inputs.hidden(step, layer, n, last)
                pg.send([hidden.contiguous()], 0, tag(layer, stage, KIND_HIDDEN)).wait()
                routed, shared = torch.empty(n, h), torch.empty(n, h)
                pg.recv([routed], 0, tag(layer, stage, KIND_ROUTED)).wait()
                pg.recv([shared], 0, tag(layer, stage, KIND_SHARED)).wait()
                out = routed + shared
                reduced = out.sum(0)
                dist.all_reduce(reduced, group=self.tp[stage])
                self.got[phase][(entry, layer, stage)] = out
                last = out + 0.25 * torch.tanh(reduced / self.spec.attn_ranks)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            self.errors.append(f"{phase} entry {entry} stage {stage}: {type(exc).__name__}: {exc}")

    def run_phase(self, phase: str) -> None:
        for entry, (kind, step) in enumerate(self.spec.plan()):
            sched = self.spec.schedule(step, self.rank)
            self.send_header(_header(CMD_RUN, entry, step, kind, sched))
            if kind == CAPTURE:
                continue  # a capture runs no kernel: nothing is exchanged
            threads = [
                threading.Thread(target=self.peer, args=(phase, entry, step, s, n), name=f"attn-s{s}", daemon=True)
                for s, n in sched.items()
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(self.spec.timeout_s + 5)
                if t.is_alive():
                    self.errors.append(f"{phase} entry {entry}: {t.name} did not finish")
            if self.errors:
                return

    def summary(self, seconds: dict[str, float]) -> dict[str, Any]:
        ov, se = self.got["overlap"], self.got["serial"]
        mismatched = sorted(str(k) for k in ov.keys() & se.keys() if not torch.equal(ov[k], se[k]))
        return {
            "role": "attention",
            "rank": self.rank,
            "ffn_rank": self.ffn,
            "pid": os.getpid(),
            "errors": self.errors,
            "messages": {k: len(v) for k, v in self.got.items()},
            "same_keys": ov.keys() == se.keys(),
            "mismatched": mismatched[:20],
            "mismatches": len(mismatched),
            "equal": not self.errors and ov.keys() == se.keys() and bool(ov) and not mismatched,
            "digest": digest(ov),
            #: Per layer: layer 0's outputs depend on the other FFN ranks only through the MoE all-to-all.
            "layer_digests": [
                digest({k: v for k, v in ov.items() if k[1] == layer}) for layer in range(self.spec.layers)
            ],
            "seconds": seconds,
        }


def digest(got: dict[tuple[int, int, int], torch.Tensor]) -> str:
    """A hash of what one phase received, in key order (bit for bit)."""
    h = hashlib.sha256()
    for key in sorted(got):
        h.update(repr(key).encode())
        h.update(got[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def attention_main(spec: RanksSpec, rank: int, ports: Ports, out: Path) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    att = AttentionRank(spec, rank, ports)
    seconds: dict[str, float] = {}
    for phase in ("overlap", "serial"):
        if phase == "serial":
            att.send_header(_header(CMD_SERIAL))
        t0 = time.perf_counter()
        att.run_phase(phase)
        seconds[phase] = round(time.perf_counter() - t0, 4)
        if att.errors:
            break
    if not att.errors:
        att.send_header(_header(CMD_STOP))
    summary = att.summary(seconds)
    (out / f"attn{rank}.json").write_text(json.dumps(summary, indent=1))
    if not att.errors:
        dist.barrier()  # rank 0 hosts the store: it goes last
        dist.destroy_process_group()
    return 0 if summary["equal"] else 1


# ---------------------------------------------------------------------------
# FFN
class PeerStageMeta:
    """A stage's DP metadata on an FFN rank: its own tokens in all (its peers'), and every attention DP rank's count
    (``num_tokens_across_dp_cpu``), as upstream's attention side gives it once it has synchronised the counts across
    its DP group (it does whenever it micro-batches): the same on every FFN rank, while ``num_tokens`` is this
    rank's own (docs/design.md, "Many FFN ranks")."""

    def __init__(self, counts: tuple[int, ...], across_dp: tuple[int, ...]) -> None:
        self.num_tokens = sum(counts)
        self.num_tokens_across_dp_cpu = across_dp

    def __repr__(self) -> str:
        return f"PeerStageMeta({self.num_tokens_across_dp_cpu})"


class RanksTransport:
    """The connector's ``a2e``/``e2a`` ops over the FFN rank's stage groups:
    A2E receives each peer's tokens into its slice of one buffer (peer
    order), E2A sends each peer its slice; both are kernels of the emulated
    device's current stream."""

    def __init__(self, spec: RanksSpec, groups: list[Any], rank: int) -> None:
        self.spec = spec
        self.groups = groups
        #: Stage -> the current step's token counts per peer (set per step).
        self.counts: dict[int, tuple[int, ...]] = {}
        self.link_ns = round(spec.link_model_s * 1e9) if spec.timing == "model" else None
        #: This rank's A2E link takes this much more (``link_extra_s``).
        self.a2e_extra_ns = round(spec.link_extra_s.get(rank, 0.0) * 1e9) if self.link_ns is not None else 0

    def _hold(self, start_ns: int, kind: str) -> None:
        if self.link_ns is not None:
            hold_until(start_ns + self.link_ns, kind)

    def a2e(
        self, *, group: str, stage: int, layer: int, num_tokens: int, max_num_tokens: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(num_tokens)
        counts = self.counts[stage]
        if sum(counts) != n:
            raise RuntimeError(f"stage {stage}: a2e of {n} tokens, the peers send {counts}")
        hidden = torch.full((n, self.spec.hidden), float("nan"))
        pg, t = self.groups[stage], tag(layer, stage, KIND_HIDDEN)

        def kernel() -> None:
            start = kernel_start_ns()
            off = 0
            for i, c in enumerate(counts):
                pg.recv([hidden[off : off + c]], 1 + i, t).wait()
                off += c
            slow = self.spec.link_extra_stage in (None, stage)
            self._hold(start + (self.a2e_extra_ns if slow else 0), "a2e")

        launch(kernel, writes=(hidden,), kind="a2e", cores=self.spec.cam_cores, resident=True)
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
        counts = self.counts[stage]
        pg = self.groups[stage]

        def kernel() -> None:
            start = kernel_start_ns()
            if int(atten_batch_size[0]) != routed.shape[0]:
                raise RuntimeError(f"stage {stage}: e2a batch size does not match its a2e")
            off = 0
            for i, c in enumerate(counts):
                pg.send([routed[off : off + c].contiguous()], 1 + i, tag(layer, stage, KIND_ROUTED)).wait()
                part = torch.zeros(c, routed.shape[1]) if shared is None else shared[off : off + c].contiguous()
                pg.send([part], 1 + i, tag(layer, stage, KIND_SHARED)).wait()
                off += c
            self._hold(start, "e2a")

        launch(kernel, kind="e2a", cores=self.spec.cam_cores, resident=True)


class CollectiveFFN:
    """The FFN model (``compute_ffn_output``): the MoE block as one kernel,
    then a gloo all-to-all on the FFN default group (MC2's dispatch and
    combine) as a kernel of the same stream, whose result is added to the
    routed output. Each row carries (layer, call number) and every rank
    checks its peers' match, so a wrong pairing raises."""

    def __init__(self, moe: Any, payload_cls: Any, spec: RanksSpec, rank: int) -> None:
        self.moe, self.payload_cls, self.spec, self.rank = moe, payload_cls, spec, rank
        self.slowdown = float(spec.straggler.get(rank, 1.0))
        self.modelled = spec.timing == "model"
        self.calls = 0
        #: This rank's own timing noise: up to ``noise_s`` more on each FFN kernel, seeded per rank.
        self.noise_s = float(spec.noise_s.get(rank, 0.0))
        self.noise = random.Random(spec.seed * 7919 + rank + 1)
        self.fault_now: str | None = None
        self.faulted = False

    def begin_step(self, step: int) -> None:
        self.calls = 0
        fault = self.spec.fault.get(self.rank)
        #: The fault this step's first FFN kernel runs into, once.
        self.fault_now = fault[0] if fault is not None and fault[1] == step and not self.faulted else None
        self.faulted = self.faulted or self.fault_now is not None

    def compute_ffn_output(self, *, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        x, call = hidden_states, self.calls
        self.calls += 1
        routed, shared, out = (torch.full_like(x, float("nan")) for _ in range(3))
        extra_s = self.noise.uniform(0.0, self.noise_s) if self.noise_s else 0.0
        ffn_s = self.spec.ffn_model_s * self.slowdown + extra_s if self.modelled else None
        coll_s = self.spec.coll_model_s if self.modelled else None
        if self.spec.vector_cores is not None and self.spec.moe_dispatch:  # MC2's dispatch opens the MoE block
            gate_s = self.spec.gate_s.get(self.rank)
            if gate_s and self.modelled:
                launch(lambda: None, model_s=gate_s, kind="moe-gate")
            launch(
                lambda: self._pairing(layer_idx, call, "dispatch"),
                model_s=coll_s,
                kind="moe-dispatch",
                cores=self.spec.moe_cores,
                resident=True,
            )
        launch(
            lambda: self._ffn(x, layer_idx, routed, shared, extra_s),
            writes=(routed, shared),
            model_s=ffn_s,
            kind="ffn",
            cores=self.spec.ffn_cores,
        )
        launch(
            lambda: self._all_to_all(layer_idx, call, routed, out),
            writes=(out,),
            model_s=coll_s,
            kind="moe-a2a",
            cores=self.spec.moe_cores,
            resident=True,
        )
        return self.payload_cls(routed_output=out, shared_output=shared)

    def _ffn(self, x: torch.Tensor, layer: int, routed: torch.Tensor, shared: torch.Tensor, extra_s: float) -> None:
        if self.fault_now is not None:
            fault, self.fault_now = self.fault_now, None
            if fault == "exit":
                os._exit(17)  # a crashed FFN rank: no clean-up, no goodbye to its peers
            os.kill(os.getpid(), signal.SIGSTOP)  # a hung FFN rank: every thread stops, its heartbeat too
        t0 = time.perf_counter()
        r, sh = self.moe.compute(x, layer)
        if not self.modelled:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0) + extra_s)
        hold()  # a modelled kernel publishes at its modelled end
        routed.copy_(r)
        shared.copy_(sh)

    def _pairing(self, layer: int, call: int, what: str) -> None:
        """A collective of every FFN rank that carries only (layer, call), checked on arrival (MC2's dispatch)."""
        import torch.distributed as dist

        tags = torch.tensor([[float(layer), float(call)]]).expand(self.spec.ffn_ranks, 2).contiguous()
        recv = torch.empty_like(tags)
        dist.all_to_all_single(recv, tags)
        if not torch.equal(recv, tags):
            raise RuntimeError(
                f"FFN rank {self.rank}: MoE {what} of (layer, call) ({layer}, {call}) paired with {recv}"
            )

    def _all_to_all(self, layer: int, call: int, routed: torch.Tensor, out: torch.Tensor) -> None:
        import torch.distributed as dist

        size, h = self.spec.ffn_ranks, self.spec.hidden
        summary = routed.sum(0)
        tags = torch.tensor([[float(layer), float(call)]]).expand(size, 2)
        send = torch.cat([torch.stack([summary * (j + 1) for j in range(size)]), tags], dim=1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        if not torch.equal(recv[:, h:], tags):
            raise RuntimeError(
                f"FFN rank {self.rank}: MoE all-to-all of (layer, call) ({layer}, {call}) paired with "
                f"{recv[:, h:].tolist()}"
            )
        torch.add(routed, 0.1 * torch.tanh(recv[:, :h].sum(0) / size), out=out)


def step_path(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The path one step took, from two ``camp2p_overlap.stats()``: a graph
    replay (``replay:<variant>``), a capture (``capture:<variants>``), an
    engaged eager step (its layout), ``serial``, or ``unpatched`` (nothing
    counted: the patch removed)."""

    def delta(key: str) -> dict[str, int]:
        b = before.get(key, {})
        return {k: v - b.get(k, 0) for k, v in after.get(key, {}).items() if v - b.get(k, 0) > 0}

    if replays := delta("graph_replays"):
        return "replay:" + "+".join(sorted(replays))
    if captures := delta("graph_captures"):
        return "capture:" + "+".join(sorted(captures))
    if layouts := delta("layout_steps"):
        return "+".join(sorted(layouts))
    steps = delta("steps")
    if steps.get("serial"):
        return "serial"
    return "+".join(sorted(steps)) if steps else "unpatched"


class FfnRank:
    def __init__(self, spec: RanksSpec, rank: int, ports: Ports, loaded_by: str) -> None:

        import camp2p_overlap
        from camp2p_overlap.emulation import standins
        from camp2p_overlap.emulation.moe import MoEFFN, MoEShape
        from camp2p_overlap.emulation.world import AfdConfig, HFConfig, ModelConfig

        self.spec, self.rank, self.loaded_by = spec, rank, loaded_by
        emulated_device.set_core_budget(spec.vector_cores, reported=spec.report_cores, order=spec.core_order)
        self.applied_at_start = camp2p_overlap.is_applied()
        if spec.graphs:
            emulated_device.as_torch_npu()  # before the runner: it takes its graph pool from torch.npu
        standins.install(standins.REAL_ROOT)
        runner_mod, conn_mod, meta_mod = standins.import_standins(standins.REAL_ROOT)
        self.report = camp2p_overlap.status().to_dict()
        _init_world(spec, ports.ffn, rank, spec.ffn_ranks)  # the FFN server's own world: FFN ranks only
        self.store = _store(spec, ports, host=False)
        self.ctrl, groups = afd_groups(spec, self.store, rank, 0)
        self.transport = RanksTransport(spec, groups, rank)
        shape = MoEShape(hidden=spec.hidden, ffn=2 * spec.hidden, experts=4, top_k=2, shared_expert=True)
        moe = MoEFFN(shape, seed=spec.ffn_seed.get(rank, spec.seed))
        self.model = CollectiveFFN(moe, meta_mod.AFDF2ATransferPayload, spec, rank)
        self.runner = runner_mod.AFDNPUFFNModelRunner(
            connector=conn_mod.CAMP2pAFDConnector(self.transport, hidden_size=spec.hidden, aiv_num=spec.cam_cores),
            model=self.model,
            num_layers=spec.layers,
            max_num_tokens=spec.tokens * spec.peers_per_ffn,
            afd_config=AfdConfig(),
            device=torch.device("cpu"),
            model_config=ModelConfig(HFConfig()),
            use_aclgraph=spec.graphs,
        )
        self.steps: list[dict[str, Any]] = []
        #: Graph key -> the variant(s) its capture recorded (the overlap phase's).
        self.captured: dict[Any, str] = {}

    def headers(self) -> list[torch.Tensor]:
        hs = []
        for i in range(self.spec.peers_per_ffn):
            h = torch.empty(HEADER, dtype=torch.int64)
            self.ctrl.recv([h], 1 + i, CTRL_TAG).wait()
            hs.append(h)
        if any(
            not torch.equal(h[:4], hs[0][:4]) or not torch.equal(h[4 : 4 + MAX_STAGES], hs[0][4 : 4 + MAX_STAGES])
            for h in hs
        ):
            raise RuntimeError(f"FFN rank {self.rank}: its peers disagree on the step: {[h.tolist() for h in hs]}")
        return hs

    def run_entry(self, phase: str, hs: list[torch.Tensor]) -> None:
        import camp2p_overlap

        entry, step, kind = int(hs[0][1]), int(hs[0][2]), KINDS[int(hs[0][3])]
        stages = [int(s) for s in hs[0][4 : 4 + MAX_STAGES] if int(s) >= 0]
        counts = {s: tuple(int(h[4 + MAX_STAGES + i]) for h in hs) for i, s in enumerate(stages)}
        # What the attention side's DP sync gives every FFN rank alike: each attention rank's count (the schedule is
        # a function of the spec, so the FFN rank reads it there instead of an all-reduce of the attention ranks').
        across = {s: tuple(self.spec.schedule(step, a)[s] for a in range(self.spec.attn_ranks)) for s in counts}
        dp = {s: PeerStageMeta(c, across[s]) for s, c in counts.items()}
        self.transport.counts = counts
        self.model.begin_step(step)
        flags = {WARMUP: {"is_warmup": True}, CAPTURE: {"is_graph_capturing": True}}.get(kind, {})
        key = self.runner._make_graph_key(dp) if self.spec.graphs else None
        replays = kind == STEP and key in self.runner._acl_graphs
        before = camp2p_overlap.stats()
        t0 = time.perf_counter()
        self.runner.execute_ffn_step(dp_metadata_list=dp, **flags)
        emulated_device.synchronize()  # the step's kernels ran (a kernel's error raises here)
        seconds = time.perf_counter() - t0
        self.steps.append(
            {
                "phase": phase,
                "entry": entry,
                "step": step,
                "kind": kind,
                "stages": stages,
                "tokens": {str(s): list(c) for s, c in counts.items()},
                "path": self.path(phase, key, replays, step_path(before, camp2p_overlap.stats())),
                "seconds": round(seconds, 6),
            }
        )

    def path(self, phase: str, key: Any, replays: bool, counted: str) -> str:
        """The entry's path: what the counters say; a replay they do not count
        (a graph of ``GRAPH=1``, or after ``unpatch()``) as ``replay:`` the
        variant its key captured (``unpatched`` in the serial phase)."""
        if counted.startswith("capture:"):
            self.captured[key] = counted.split(":", 1)[1]
        if replays and not counted.startswith("replay:"):
            return "replay:" + ("unpatched" if phase == "serial" else self.captured.get(key, "?"))
        return counted

    def loop(self) -> bool | None:
        """Run entries until STOP; returns what ``unpatch()`` returned."""
        import camp2p_overlap

        phase, unpatched = "overlap", None
        while True:
            hs = self.headers()
            cmd = int(hs[0][0])
            if cmd == CMD_STOP:
                return unpatched
            if cmd == CMD_SERIAL:
                unpatched = camp2p_overlap.unpatch(timeout=self.spec.timeout_s)
                self.runner._acl_graphs.clear()  # the serial phase captures upstream's own graphs
                phase = "serial"
                continue
            self.run_entry(phase, hs)


def _core_counts() -> dict[str, int] | None:
    """The core pool's counts: kernels that waited for cores, kernels that ran short of them."""
    from camp2p_overlap.emulation.device.cores import core_pool

    pool = core_pool()
    return None if pool is None else {"total": pool.total, "waits": pool.waits, "short": pool.short}


def ffn_main(spec: RanksSpec, rank: int, ports: Ports, out: Path) -> int:
    import torch.distributed as dist

    from camp2p_overlap.emulation.gloo import load_plugins_like_vllm

    torch.set_num_threads(1)
    loaded_by = load_plugins_like_vllm()
    import camp2p_overlap

    error = unpatched = ffn = None
    try:
        ffn = FfnRank(spec, rank, ports, loaded_by)
        unpatched = ffn.loop()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    summary = {
        "role": "ffn",
        "rank": rank,
        "pid": os.getpid(),
        "peers": spec.peers_of(rank),
        "plugins_loaded_by": loaded_by,
        "applied_by_entry_point": None if ffn is None else ffn.applied_at_start,
        "report": None if ffn is None else ffn.report,
        "steps": [] if ffn is None else ffn.steps,
        "stats": camp2p_overlap.stats(),
        "timing": emulated_device.take_timing().to_dict() if spec.timing == "model" else None,
        "unpatched": unpatched,
        "cores": _core_counts(),
        "error": error,
    }
    (out / f"ffn{rank}.json").write_text(json.dumps(summary, indent=1))
    if error is None:
        dist.destroy_process_group()
    return 0 if error is None else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one process of the multi-rank world (started by ranks.run_world)")
    ap.add_argument("--role", choices=["attention", "ffn"], required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ports", required=True, help="attention world, FFN world, AFD store")
    a = ap.parse_args(argv)
    spec = RanksSpec.from_json(a.spec.read_text())
    ports = Ports(*(int(p) for p in a.ports.split(",")))
    run = attention_main if a.role == "attention" else ffn_main
    return run(spec, a.rank, ports, a.out)


if __name__ == "__main__":
    sys.exit(main())
