"""The emulated CAMP2P FFN rank on a real device (CUDA GPU, or an Ascend NPU
through torch_npu), for the benchmark's ``--device cuda|npu``.

What is real and what is modeled:

* FFN compute: real bf16 matmuls on the device (a MoE block whose routing
  is applied densely, so it never synchronizes with the host), on the
  caller's current stream C.
* A2E/E2A: device work of the modeled duration on whatever stream the
  patch layer puts them on: a real device copy of the data moved, then a
  busy-wait kernel (``torch.cuda._sleep``) calibrated to the link model's
  time for the bytes. Without ``_sleep`` (some torch_npu builds) repeated
  copies of a scratch buffer, calibrated the same way, stand in for it.
* Data dependencies are those of stream order: what an A2E of layer L
  returns is computed on the device from what the stage's E2A of the
  previous layer sent, exactly as in the CPU emulation.

What is NOT modeled: the attention peer. Nothing on the host blocks and no
op waits for a peer, so the attention time (``attn_s``) and the protocol
checks of the CPU emulation (group order, deadlock on a wrong order) are
absent here; the device emulation measures only how communication-shaped
device work overlaps with compute. Use the CPU emulation for protocol
behaviour.

The transport keeps the interface of ``EmulatedTransport`` that the
stand-in connector and ``World`` use: ``a2e``, ``e2a``, ``begin_step`` and
``results``. Importing this module needs only torch; a device is needed
only by :func:`build_device_world`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from camp2p_overlap.core.trace import TraceOp
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.moe import MoEFFN, MoEShape
from camp2p_overlap.emulation.world import (
    AfdConfig,
    AttentionInputs,
    EmulatedModel,
    HFConfig,
    LinkModel,
    ModelConfig,
    World,
    WorldSpec,
)


class DeviceUnavailable(RuntimeError):
    """The requested device cannot be used; the message says why."""


def device_module(kind: str) -> ModuleType:
    """``torch.cuda`` or ``torch.npu`` when a device is there, else raise
    :class:`DeviceUnavailable` with a message for the command line."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device cuda needs a CUDA GPU: torch.cuda.is_available() is False")
        return torch.cuda
    if kind == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise DeviceUnavailable("--device npu needs torch_npu, which is not installed")
        try:
            importlib.import_module("torch_npu")
        except Exception as exc:  # reported to the user
            raise DeviceUnavailable(f"--device npu: importing torch_npu failed: {type(exc).__name__}: {exc}") from exc
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            raise DeviceUnavailable("--device npu needs an Ascend NPU: torch.npu.is_available() is False")
        return npu
    raise DeviceUnavailable(f"no device emulation for {kind!r} (use cpu, cuda or npu)")


class DeviceDelay:
    """Busy device work of a given duration on the current stream."""

    def __init__(self, mod: ModuleType, device: torch.device) -> None:
        self.mod = mod
        self._sleep = getattr(mod, "_sleep", None)
        self._scratch_src = torch.zeros(1 << 18, device=device)
        self._scratch_dst = torch.empty_like(self._scratch_src)
        self.unit_s = self._calibrate()

    def _unit(self, n: int) -> None:
        if self._sleep is not None:
            self._sleep(n)
        else:
            for _ in range(n):
                self._scratch_dst.copy_(self._scratch_src)

    def _calibrate(self) -> float:
        """Seconds per unit (one ``_sleep`` cycle, or one scratch copy)."""
        n = 1_000_000 if self._sleep is not None else 200
        self._unit(n // 10)  # warm-up
        self.mod.synchronize()
        start, end = self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True)
        start.record()
        self._unit(n)
        end.record()
        end.synchronize()
        return max(start.elapsed_time(end) / 1e3, 1e-9) / n

    def __call__(self, seconds: float) -> None:
        units = int(seconds / self.unit_s)
        if units > 0:
            self._unit(units)


class DeviceFFN(MoEFFN):
    """A MoE block for the device: router, top-k weights applied densely
    (every expert runs on every token, weighted by its routing weight, 0
    outside the top-k), and a shared expert. No host synchronization."""

    def __init__(
        self, shape: MoEShape, *, seed: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        super().__init__(shape, seed=seed, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        wts = self.groups[layer_idx % len(self.groups)]
        probs = torch.softmax((x @ wts["router"]).float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.shape.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter_(1, top_i, top_w).to(x.dtype)
        routed = torch.zeros_like(x)
        for e in range(self.shape.experts):
            gate, up = (x @ wts["gate_up"][e]).chunk(2, dim=-1)
            routed += dense[:, e : e + 1] * ((torch.nn.functional.silu(gate) * up) @ wts["down"][e])
        shared = None
        if self.shape.shared_expert:
            gate, up = (x @ wts["shared_gate_up"]).chunk(2, dim=-1)
            shared = (torch.nn.functional.silu(gate) * up) @ wts["shared_down"]
        return routed, shared


@dataclass
class _Timed:
    kind: str
    layer: int | None
    stage: int | None
    stream: str
    start: Any
    end: Any
    step: int


class DeviceTiming:
    """Device timing events around each op while :attr:`active`, resolved
    into :class:`TraceOp` (device time, ns from the first event) after a
    synchronize. Stream names: ``C`` for the compute stream, ``K<stage>``
    for any other stream an op of that stage ran on."""

    def __init__(self, mod: ModuleType, compute_stream: Any) -> None:
        self.mod = mod
        self.compute_stream = compute_stream
        self.active = False
        self._pending: list[_Timed] = []

    def stream_name(self, stage: int | None) -> str:
        current = self.mod.current_stream()
        return "C" if current == self.compute_stream else f"K{stage}"

    def begin(self) -> Any:
        if not self.active:
            return None
        ev = self.mod.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self, kind: str, layer: int | None, stage: int | None, start: Any, step: int) -> None:
        if start is None:
            return
        ev = self.mod.Event(enable_timing=True)
        ev.record()
        self._pending.append(_Timed(kind, layer, stage, self.stream_name(stage), start, ev, step))

    def resolve(self) -> list[TraceOp]:
        """Synchronize and turn the recorded events into trace ops."""
        self.mod.synchronize()
        if not self._pending:
            return []
        origin = self._pending[0].start
        ops = [
            TraceOp(
                t.kind,
                t.layer,
                t.stage,
                t.stream,
                int(origin.elapsed_time(t.start) * 1e6),
                int(origin.elapsed_time(t.end) * 1e6),
                t.step,
            )
            for t in self._pending
        ]
        self._pending.clear()
        shift = -min(0, *(o.start_ns for o in ops))
        for o in ops:
            o.start_ns += shift
            o.end_ns += shift
        return ops


class DeviceTransport:
    """The ``a2e``/``e2a`` ops as device work of modeled duration, on the
    current stream, with no host-side blocking. Same interface as
    ``EmulatedTransport`` (``a2e``, ``e2a``, ``begin_step``, ``results``)."""

    def __init__(
        self,
        *,
        hidden: int,
        link: LinkModel,
        device: torch.device,
        delay: DeviceDelay,
        timing: DeviceTiming,
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        max_tokens: int = 4096,
        base_pool: int = 4,
    ) -> None:
        self.hidden = hidden
        self.link = link
        self.device = device
        self.delay = delay
        self.timing = timing
        self.dtype = dtype
        self.results: dict[tuple[int, int], torch.Tensor] = {}
        #: No attention peer on the device: kept empty (same attribute as the CPU transport).
        self.peer_wait_ns: dict[tuple[int, int], int] = {}
        self.step = 0
        self._last: dict[int, torch.Tensor] = {}
        #: id() of each received hidden-states tensor of this step -> its stage (for timing labels).
        self.stage_of: dict[int, int] = {}
        self.inputs = AttentionInputs(
            hidden=hidden, max_tokens=max_tokens, seed=seed, pool=base_pool, dtype=dtype, device=device
        )

    def begin_step(self, step: int, layers: Sequence[int], stages: Sequence[int]) -> None:
        self.step = step
        self.results = {}
        self._last = {}
        self.stage_of = {}

    def a2e(
        self, *, group: str, stage: int, layer: int, num_tokens: int, max_num_tokens: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.timing.begin()
        n = int(num_tokens)
        # Allocated on the current (side) stream: the data moved.
        hidden = self.inputs.hidden(self.step, layer, n, self._last.get(stage))
        self.delay(self.link.seconds(n * self.hidden * hidden.element_size()))
        self.timing.end("a2e", layer, stage, start, self.step)
        self.stage_of[id(hidden)] = stage
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
        start = self.timing.begin()
        nbytes = routed.numel() * routed.element_size()
        if shared is not None:
            nbytes += shared.numel() * shared.element_size()
        out = routed if shared is None else routed + shared
        out = out.detach().clone()  # the data moved
        self.delay(self.link.seconds(nbytes))
        self.timing.end("e2a", layer, stage, start, self.step)
        self.results[(layer, stage)] = out
        self._last[stage] = out


class TimedModel(EmulatedModel):
    """``compute_ffn_output`` bracketed by device timing events."""

    def __init__(self, moe: Any, *, timing: DeviceTiming, transport: DeviceTransport, **kw: Any) -> None:
        super().__init__(moe, **kw)
        self.timing = timing
        self.transport = transport

    def compute_ffn_output(self, *, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        start = self.timing.begin()
        out = super().compute_ffn_output(hidden_states=hidden_states, layer_idx=layer_idx)
        stage = self.transport.stage_of.get(id(hidden_states))
        self.timing.end("ffn", layer_idx, stage, start, self.transport.step)
        return out


@dataclass
class DeviceWorld:
    """A :class:`World` on a device, plus what the benchmark needs to time it."""

    world: World
    mod: ModuleType
    timing: DeviceTiming
    device: torch.device

    def synchronize(self) -> None:
        self.mod.synchronize()


def build_device_world(spec: WorldSpec, kind: str, *, root: str = standins.REAL_ROOT) -> DeviceWorld:
    """Build the emulated FFN rank on device ``kind`` (``cuda`` or ``npu``)."""
    mod = device_module(kind)
    device = torch.device(kind, mod.current_device())
    standins.install(root)
    runner_mod, conn_mod, meta_mod = standins.import_standins(root)
    max_tokens = max(spec.tokens, 1)
    timing = DeviceTiming(mod, mod.current_stream())
    transport = DeviceTransport(
        hidden=spec.shape.hidden,
        link=spec.link,
        device=device,
        delay=DeviceDelay(mod, device),
        timing=timing,
        seed=spec.seed,
        max_tokens=max_tokens,
    )
    connector = conn_mod.CAMP2pAFDConnector(transport, hidden_size=spec.shape.hidden)
    model = TimedModel(
        DeviceFFN(spec.shape, seed=spec.seed, device=device),
        timing=timing,
        transport=transport,
        return_payload=spec.return_payload,
        payload_cls=meta_mod.AFDF2ATransferPayload,
    )
    runner = runner_mod.AFDNPUFFNModelRunner(
        connector=connector,
        model=model,
        num_layers=spec.layers,
        max_num_tokens=max_tokens,
        afd_config=AfdConfig(compute_gate_on_attention=spec.compute_gate_on_attention),
        device=device,
        model_config=ModelConfig(HFConfig(spec.first_k_dense_replace, spec.moe_layer_freq)),
    )
    world = World(spec, runner, connector, transport, (runner_mod, conn_mod, meta_mod))  # type: ignore[arg-type]
    return DeviceWorld(world, mod, timing, device)
