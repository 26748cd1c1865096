"""An emulated CAMP2P world on one host: attention peers, a modeled link,
a MoE FFN doing real tensor work, and the stand-in runner and connector.

The attention peer of each stage keeps the real data dependencies: A2E of
layer L is available only after E2A of the stage's previous layer arrived
plus a modeled attention time, and its hidden states are computed from
what that E2A delivered. A schedule that would deadlock on hardware (an A2E
queued ahead of its group's E2A on one stream) therefore waits here too,
until the op timeout (the stand-in for HCCL's) fires. Two ops of the same
stage group running at once is a :class:`ProtocolError`, as it would corrupt
the group's HCCL window on hardware.

Communication time (the link, and an A2E's wait for its peer) is slept by
default, taking no compute. With ``WorldSpec.comm_cores = N`` it is spent
busy on N cores instead (:mod:`camp2p_overlap.emulation.contention`), as
CAM's kernels spin on their vector cores, so a lookahead A2E that waits a
whole attention time keeps those cores from the FFN.

``WorldSpec.timing = "model"`` puts every kernel on the emulated device's
modelled timeline (``camp2p_overlap.emulation.device``: ``launch(model_s=)``,
``hold_until``): the FFN takes its calibrated duration
(:mod:`camp2p_overlap.emulation.ffn_timing`), an E2A its link time from its
modelled start, an A2E its link time from the later of its modelled start
and the time its attention peer answers; attention answers ``attn_s`` after
the E2A's modelled end (never before the E2A really started). Each comm
kernel holds its stream until its modelled end, so a thread's late wake-up
does not lengthen it. ``"wall"`` (the default): each kernel takes the wall
time its work and its sleeps take.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.contention import CoreSpinner
from camp2p_overlap.emulation.device import hold_until, kernel_start_ns, launch
from camp2p_overlap.emulation.ffn_timing import calibrate_ffn
from camp2p_overlap.emulation.moe import MoEFFN, MoEShape

#: ``WorldSpec.timing``: every kernel on the modelled timeline, or wall clock.
TIMINGS = ("wall", "model")


class PeerTimeoutError(TimeoutError):
    """An emulated communication op waited longer than the op timeout."""


class ProtocolError(RuntimeError):
    """The emulated protocol was violated (group order, wrong layer)."""


@dataclass(frozen=True)
class LinkModel:
    latency_s: float = 100e-6
    bandwidth_Bps: float = 2e9

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class StageMeta:
    """Per-stage DP metadata as the FFN side sees it (token count)."""

    num_tokens: int


@dataclass
class _Peer:
    stage: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    layers: tuple[int, ...] = ()
    next_a2e: int = 0
    ready_at: float | None = None
    awaiting_e2a: int | None = None
    last_out: torch.Tensor | None = None
    busy: str | None = None
    stopped: bool = False


#: A fault hook: called as hook(kind, layer, stage) at the start of each
#: emulated op ("a2e", "e2a"); it may raise, sleep, or stop the peer.
FaultHook = Callable[[str, int, int], None]


class AttentionInputs:
    """What the emulated attention ranks send: a small pool of deterministic
    base activations (per seed), and for every layer after a stage's first,
    the base plus a function of what that stage's previous E2A delivered, so
    each layer's input depends on the previous layer's FFN output (a wrong
    or reordered E2A changes every later input). Shared by the CPU, device
    and two-process emulations so they all model the same data."""

    def __init__(
        self,
        *,
        hidden: int,
        max_tokens: int,
        seed: int = 0,
        pool: int = 4,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(seed + 7919)
        self.base = [torch.randn(max_tokens, hidden, generator=g).to(device=device, dtype=dtype) for _ in range(pool)]

    def hidden(
        self, step: int, layer: int, num_tokens: int, last: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The hidden states attention sends; written into ``out`` when given
        (the same values, bit for bit)."""
        base = self.base[(layer + step) % len(self.base)][:num_tokens]
        if out is not None:
            return out.copy_(base) if last is None else torch.add(base, 0.5 * torch.tanh(last[:num_tokens]), out=out)
        return base.clone() if last is None else base + 0.5 * torch.tanh(last[:num_tokens])


class EmulatedTransport:
    """Plays the ``a2e``/``e2a`` custom ops and the attention ranks."""

    def __init__(
        self,
        *,
        hidden: int,
        link: LinkModel = LinkModel(),
        attn_s: float = 0.0,
        op_timeout_s: float = 30.0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_tokens: int = 4096,
        base_pool: int = 4,
        comm_cores: int = 0,
        modelled: bool = False,
    ) -> None:
        if modelled and comm_cores:
            raise ValueError(
                "modelled kernels and comm_cores exclude each other: the comm cores' busy-wait takes compute from "
                "the FFN, which a modelled FFN hides under its margin"
            )
        self.hidden = hidden
        self.link = link
        #: The comm kernels take their modelled duration (module docstring).
        self.modelled = modelled
        #: ``comm_cores`` 0: link and peer waits sleep (take no compute);
        #: N >= 1: they busy-wait on N cores (:mod:`emulation.contention`),
        #: as CAM's kernels spin on their vector cores.
        self.spinner = CoreSpinner(comm_cores)
        self.attn_s = attn_s
        self.op_timeout_s = op_timeout_s
        self.dtype = dtype
        self.peers: dict[int, _Peer] = {}
        self.results: dict[tuple[int, int], torch.Tensor] = {}
        #: Per (layer, stage) of the current step: ns each A2E spent waiting
        #: for its attention peer before the modeled link time (the benchmark
        #: subtracts it to get the link part of a measured A2E).
        self.peer_wait_ns: dict[tuple[int, int], int] = {}
        self.step = 0
        self.fault_hook: FaultHook | None = None
        #: group -> the op running on it: two at once on one group is a ProtocolError.
        self._group_busy: dict[str, str] = {}
        self.inputs = AttentionInputs(hidden=hidden, max_tokens=max_tokens, seed=seed, pool=base_pool, dtype=dtype)
        self._lock = threading.Lock()

    # -- step control ----------------------------------------------------
    def begin_step(self, step: int, layers: Sequence[int], stages: Sequence[int]) -> None:
        now = time.perf_counter()
        with self._lock:
            self.step = step
            self.results = {}
            self.peer_wait_ns = {}
            self.peers = {s: _Peer(stage=s, layers=tuple(layers), ready_at=now + self.attn_s) for s in stages}

    def stop_peer(self, stage: int) -> None:
        """The attention rank of ``stage`` stops answering."""
        p = self.peers[stage]
        with p.cond:
            p.stopped = True
            p.cond.notify_all()

    # -- ops -----------------------------------------------------------
    def _enter(self, p: _Peer, what: str, group: str) -> None:
        with p.cond:
            if p.busy is not None:
                raise ProtocolError(
                    f"stage {p.stage}: {what} started while {p.busy} is still running on the same group"
                )
            with self._lock:
                other = self._group_busy.get(group)
                if other is not None:
                    raise ProtocolError(f"stage {p.stage}: {what} started while {other} is still running on {group}")
                self._group_busy[group] = what
            p.busy = what

    def _leave(self, p: _Peer, group: str) -> None:
        with p.cond:
            p.busy = None
            with self._lock:
                self._group_busy.pop(group, None)

    def a2e(
        self, *, group: str, stage: int, layer: int, num_tokens: int, max_num_tokens: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like the ``a2e`` custom op: allocate the receive buffer and launch
        the kernel that fills it on the current stream of the emulated
        device (it runs after this returns, on every path). The buffer
        starts as NaN, the pattern a debug allocator leaves: a reader that
        did not wait for the kernel sees it, and its output cannot equal
        the serial run's."""
        n = int(num_tokens)
        hidden = torch.full((n, self.hidden), float("nan"), dtype=self.dtype)
        launch(lambda: self._a2e_kernel(group, stage, layer, n, hidden), writes=(hidden,))
        return hidden, torch.tensor([n])

    def _a2e_kernel(self, group: str, stage: int, layer: int, n: int, out: torch.Tensor) -> None:
        start_ns = kernel_start_ns() if self.modelled else 0
        ready_ns = start_ns  # modelled: when the peer's data is there (set below)
        p = self.peers[stage]
        what = f"a2e(L{layer}) on {group}"
        self._enter(p, what, group)
        try:
            if self.fault_hook is not None:
                self.fault_hook("a2e", layer, stage)
            with p.cond:
                if p.next_a2e >= len(p.layers) or p.layers[p.next_a2e] != layer:
                    nxt = p.layers[p.next_a2e] if p.next_a2e < len(p.layers) else None
                    raise ProtocolError(f"stage {stage}: a2e for layer {layer}, attention sends layer {nxt}")
                waited_from = time.perf_counter_ns()
                deadline = time.perf_counter() + self.op_timeout_s
            if self.spinner.spins:
                # The kernel spins on its cores while it waits for the peer.
                self.spinner.until(
                    lambda: not p.stopped and p.ready_at is not None and time.perf_counter() >= p.ready_at,
                    hard_deadline=deadline,
                )
            with p.cond:
                while True:
                    now = time.perf_counter()
                    if self.modelled and not p.stopped and p.ready_at is not None:
                        # Answered (or sure to be at ready_at): the modelled wait runs from the
                        # modelled start to the answer, and one hold below ends it with the link.
                        ready_ns = max(start_ns, round(p.ready_at * 1e9))
                        self.peer_wait_ns[(layer, stage)] = ready_ns - start_ns
                        break
                    if not p.stopped and p.ready_at is not None and now >= p.ready_at:
                        self.peer_wait_ns[(layer, stage)] = time.perf_counter_ns() - waited_from
                        break
                    if now >= deadline:
                        raise PeerTimeoutError(
                            f"{what}: no data from attention after {self.op_timeout_s:.1f} s"
                            + (" (peer stopped)" if p.stopped else " (waiting for this stage's e2a)")
                        )
                    wait = deadline - now
                    if p.ready_at is not None and not p.stopped:
                        wait = min(wait, p.ready_at - now)
                    p.cond.wait(max(wait, 0.0))
                last = p.last_out
            link_s = self.link.seconds(n * self.hidden * self._itemsize())
            if self.modelled:  # computed now, the buffer filled at the modelled end (a copy)
                received = self.inputs.hidden(self.step, layer, n, last)
                hold_until(ready_ns + round(link_s * 1e9), "a2e")
                out.copy_(received)
            else:
                self.spinner.wait(link_s)
                self.inputs.hidden(self.step, layer, n, last, out=out)
            with p.cond:
                p.next_a2e += 1
                p.ready_at = None
                p.awaiting_e2a = layer
        finally:
            self._leave(p, group)

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
        """Like the ``e2a`` custom op: launch the kernel that reads the FFN
        output and delivers it (after this returns)."""
        launch(lambda: self._e2a_kernel(group, stage, layer, routed, shared, atten_batch_size))

    def _e2a_kernel(
        self,
        group: str,
        stage: int,
        layer: int,
        routed: torch.Tensor,
        shared: torch.Tensor | None,
        atten_batch_size: torch.Tensor,
    ) -> None:
        start_ns = kernel_start_ns() if self.modelled else 0
        began_ns = time.perf_counter_ns()
        p = self.peers[stage]
        what = f"e2a(L{layer}) on {group}"
        self._enter(p, what, group)
        try:
            if self.fault_hook is not None:
                self.fault_hook("e2a", layer, stage)
            with p.cond:
                if p.awaiting_e2a != layer:
                    raise ProtocolError(
                        f"stage {stage}: e2a for layer {layer}, attention expects layer {p.awaiting_e2a}"
                    )
            if int(atten_batch_size[0]) != routed.shape[0]:
                raise ProtocolError(f"stage {stage}: e2a batch size does not match its a2e")
            nbytes = routed.numel() * routed.element_size()
            if shared is not None:
                nbytes += shared.numel() * shared.element_size()
            if self.modelled:  # what it sends is read at its start, delivered at its modelled end
                out = routed if shared is None else routed + shared
                out = out.detach().clone()
                end_ns = start_ns + round(self.link.seconds(nbytes) * 1e9)
                hold_until(end_ns, "e2a")
                # Attention answers attn_s after the modelled end, and never
                # sooner after the E2A really began than that (the peer cycle).
                ready_at = max(end_ns, began_ns) / 1e9 + self.attn_s
            else:
                self.spinner.wait(self.link.seconds(nbytes))
                out = routed if shared is None else routed + shared
                out = out.detach().clone()
                ready_at = time.perf_counter() + self.attn_s
            with p.cond:
                self.results[(layer, stage)] = out
                p.last_out = out
                p.awaiting_e2a = None
                p.ready_at = ready_at
                p.cond.notify_all()
        finally:
            self._leave(p, group)

    def _itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def close(self) -> None:
        """Stop the helper threads of the busy-wait model, if any."""
        self.spinner.close()


class EmulatedModel:
    """The FFN model: ``compute_ffn_output(hidden_states=, layer_idx=)``."""

    def __init__(self, moe: MoEFFN, *, return_payload: bool = True, payload_cls: Any = None) -> None:
        self.moe = moe
        self.return_payload = return_payload and moe.shape.shared_expert
        self.payload_cls = payload_cls

    def compute_ffn_output(self, *, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        if self.return_payload and self.payload_cls is not None:
            routed, shared = self.moe(hidden_states, layer_idx)
            return self.payload_cls(routed_output=routed, shared_output=shared)
        return self.moe.combined(hidden_states, layer_idx)


@dataclass
class AfdConfig:
    connector: str = "camp2p"
    role: str = "ffn"
    compute_gate_on_attention: bool = False


@dataclass
class HFConfig:
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1


@dataclass
class ModelConfig:
    hf_config: HFConfig = field(default_factory=HFConfig)


@dataclass(frozen=True)
class WorldSpec:
    layers: int = 8
    stage_ids: tuple[int, ...] = (0, 1)
    tokens: int = 128
    shape: MoEShape = MoEShape()
    link: LinkModel = LinkModel()
    attn_s: float = 0.0
    op_timeout_s: float = 30.0
    seed: int = 0
    compute_gate_on_attention: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    return_payload: bool = True
    device: str = "cpu"
    #: The connector's micro-batch count: its HCCL groups (below 3, stages
    #: fall back as the real connector's do; 1 aliases stages 0 and 1).
    num_ubatches: int = 3
    #: Cores (CPU) or SMs (CUDA) each emulated A2E/E2A keeps busy while it
    #: waits for its peer and for the link; 0: it takes no compute.
    comm_cores: int = 0
    #: Upstream's decode graph path: the runner is built with
    #: ``use_aclgraph=True`` (:meth:`World.capture`, then replays from
    #: :meth:`World.run_step`); on ``device == "cpu"`` the emulated device is
    #: installed as ``torch.npu`` first (the runner takes its graph pool there).
    graph: bool = False
    #: ``"model"``: kernels take their modelled durations (module docstring;
    #: the FFN calibrated at ``tokens`` when the world is built, more token
    #: counts with :meth:`World.calibrate_ffn`); ``"wall"``: wall clock.
    timing: str = "wall"


@dataclass
class World:
    spec: WorldSpec
    runner: Any
    connector: Any
    transport: EmulatedTransport
    modules: tuple[ModuleType, ModuleType, ModuleType]
    steps_run: int = 0
    #: Whether :func:`build_world` installed the emulated device as
    #: ``torch.npu`` (:meth:`close` then removes it).
    installed_torch_npu: bool = False

    def layer_list(self) -> list[int]:
        return list(self.modules[0]._ffn_layer_indices(self.runner))

    @property
    def moe(self) -> MoEFFN:
        return self.runner.model.moe

    def calibrate_ffn(self, tokens: Sequence[int]) -> Any:
        """Add ``tokens`` to the FFN's timing model (``timing="model"``; call
        it with the device idle); returns the model."""
        if self.spec.timing != "model":
            raise RuntimeError("World.calibrate_ffn needs a world built with timing='model'")
        self.moe.timing = calibrate_ffn(self.moe, tokens, base=self.moe.timing)
        return self.moe.timing

    def dp_metadata(self, tokens: Mapping[int, int] | None = None) -> dict[int, StageMeta]:
        return {s: StageMeta(int(tokens[s]) if tokens else self.spec.tokens) for s in self.spec.stage_ids}

    def run_step(
        self, tokens: Mapping[int, int] | None = None, **forward_kwargs: Any
    ) -> dict[tuple[int, int], torch.Tensor]:
        """One FFN step through the runner's ``execute_ffn_step``; returns
        what attention received for each (layer, stage)."""
        self.steps_run += 1
        dp = self.dp_metadata(tokens)
        self.transport.begin_step(self.steps_run, self.layer_list(), sorted(dp))
        try:
            if forward_kwargs:
                self.runner._ffn_forward(dp_metadata_list=dp, **forward_kwargs)
            else:
                self.runner.execute_ffn_step(dp_metadata_list=dp)
        except BaseException:
            self.settle()
            raise
        # The host ran ahead of the device: attention's results are read
        # once every stream has run the step (a kernel's error raises here).
        self.synchronize()
        return dict(self.transport.results)

    def settle(self) -> None:
        """After a step that raised on the host: let the device run what the
        step had queued, and drop the errors its kernels hit on the way
        (consequences of the error being raised), so the next step starts
        on an idle device."""
        if self.spec.device == "cpu":
            emulated_device.drain_all(timeout=60.0)
            emulated_device.take_errors()

    def synchronize(self) -> None:
        """Wait for the device (the emulated one on CPU) to run everything
        queued, raising the first error a kernel hit."""
        if self.spec.device == "cpu":
            emulated_device.synchronize()
        elif self.spec.device.startswith("cuda"):
            torch.cuda.synchronize()

    # -- upstream's decode graph path (WorldSpec.graph) ---------------------
    def graph_key(self, tokens: Mapping[int, int] | None = None) -> tuple:
        """The runner's graph key of a step with ``tokens`` per stage."""
        return self.runner._make_graph_key(self.dp_metadata(tokens))

    def capture(self, tokens: Mapping[int, int] | None = None, warmups: int = 1) -> Any:
        """Capture the step of ``tokens`` in upstream's order: ``warmups``
        eager warm-up steps (``execute_ffn_step(is_warmup=True)``), then one
        capture step (``is_graph_capturing=True``), each after
        ``transport.begin_step`` and followed by :meth:`synchronize`. Returns
        the captured graph (the one already captured for the key, if any:
        upstream keeps one graph per key); :meth:`run_step` replays it from
        then on. Needs a runner with ``use_aclgraph`` (``WorldSpec.graph``)."""
        if not self.runner.use_aclgraph:
            raise RuntimeError("World.capture needs a runner with use_aclgraph (build the world with graph=True)")
        if warmups < 0:
            raise ValueError("warmups must not be negative")
        dp = self.dp_metadata(tokens)
        flags = [{"is_warmup": True}] * warmups + [{"is_graph_capturing": True}]
        for flag in flags:
            self.steps_run += 1
            self.transport.begin_step(self.steps_run, self.layer_list(), sorted(dp))
            self.runner.execute_ffn_step(dp_metadata_list=dp, **flag)
            self.synchronize()
        entry = self.runner._acl_graphs.get(self.graph_key(tokens))
        if entry is None:
            raise RuntimeError("the capture step left no graph for its key")
        return entry["graph"]

    def take_graph(self, tokens: Mapping[int, int] | None = None) -> dict[str, Any] | None:
        """Remove the runner's captured entry (``{"graph", "output"}``) for
        the key of ``tokens`` and return it (None when there is none): the
        runner runs that key eagerly again until :meth:`put_graph`."""
        return self.runner._acl_graphs.pop(self.graph_key(tokens), None)

    def put_graph(self, entry: dict[str, Any], tokens: Mapping[int, int] | None = None) -> None:
        """Give the runner ``entry`` (from :meth:`take_graph`) as its graph
        for the key of ``tokens``: :meth:`run_step` replays it."""
        self.runner._acl_graphs[self.graph_key(tokens)] = entry

    def close(self) -> None:
        """Release what the transport holds (busy-wait helper threads), and
        remove the emulated ``torch.npu`` if :func:`build_world` installed it."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()
        if self.installed_torch_npu:
            self.installed_torch_npu = False
            emulated_device.remove_torch_npu()


def build_world(spec: WorldSpec = WorldSpec(), *, root: str = standins.REAL_ROOT) -> World:
    """Import the stand-ins under ``root`` (installing the finder if needed)
    and build a runner wired to an emulated transport."""
    if spec.timing not in TIMINGS:
        raise ValueError(f"WorldSpec.timing {spec.timing!r} is not one of {', '.join(TIMINGS)}")
    if spec.timing == "model" and spec.device != "cpu":
        raise ValueError("WorldSpec.timing 'model' is for the emulated device (device 'cpu')")
    installed_npu = False
    if spec.graph and spec.device == "cpu" and not emulated_device.is_torch_npu():
        emulated_device.as_torch_npu()  # before the runner: it takes its graph pool from torch.npu
        installed_npu = True
    standins.install(root)
    runner_mod, conn_mod, meta_mod = standins.import_standins(root)
    max_tokens = max(spec.tokens, 1)
    transport = EmulatedTransport(
        hidden=spec.shape.hidden,
        link=spec.link,
        attn_s=spec.attn_s,
        op_timeout_s=spec.op_timeout_s,
        seed=spec.seed,
        max_tokens=max_tokens,
        comm_cores=spec.comm_cores,
        modelled=spec.timing == "model",
    )
    connector = conn_mod.CAMP2pAFDConnector(transport, hidden_size=spec.shape.hidden, num_ubatches=spec.num_ubatches)
    moe = MoEFFN(spec.shape, seed=spec.seed, device=spec.device)
    if spec.timing == "model":
        moe.timing = calibrate_ffn(moe, [spec.tokens])
    model = EmulatedModel(moe, return_payload=spec.return_payload, payload_cls=meta_mod.AFDF2ATransferPayload)
    runner = runner_mod.AFDNPUFFNModelRunner(
        connector=connector,
        model=model,
        num_layers=spec.layers,
        max_num_tokens=max_tokens,
        afd_config=AfdConfig(compute_gate_on_attention=spec.compute_gate_on_attention),
        device=torch.device(spec.device),
        model_config=ModelConfig(HFConfig(spec.first_k_dense_replace, spec.moe_layer_freq)),
        use_aclgraph=spec.graph,
    )
    return World(
        spec, runner, connector, transport, (runner_mod, conn_mod, meta_mod), installed_torch_npu=installed_npu
    )
