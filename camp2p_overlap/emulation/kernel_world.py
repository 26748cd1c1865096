"""The emulated CAMP2P FFN rank on a real device (CUDA GPU, or an Ascend NPU
through torch_npu), for the benchmark's ``--device cuda|npu``.

What is real and what is modeled:

* FFN compute: real bf16 matmuls on the device (a MoE block whose routing
  is applied densely, so it never synchronizes with the host, its experts
  batched into two GEMMs, so it issues the same few kernels whatever the
  number of experts), on the caller's current stream C.
* A2E/E2A: the emulated CAM kernel (:mod:`comm_kernel`) on whatever
  stream the patch layer puts them on, then a device op for the data moved.
  The kernel spins on the device's wall clock (``%globaltimer``), never on a
  calibrated cycle count; with ``comm_cores = N`` it holds N SMs for the
  op's whole duration (contention with the FFN).
* The attention peer, on the device: a stage's A2E of layer L waits, inside
  the kernel, until the stage's E2A of the previous layer has finished and
  the attention time (``attn_s``) has passed since, then spins the link
  time; the first A2E of a step waits the attention time from the step's
  start. This is the dependency cycle of the CPU world (``world.py``). An
  A2E whose E2A never comes (a schedule that deadlocks on hardware) gives up
  after the op timeout; :meth:`DeviceWorld.synchronize` then raises
  :class:`DevicePeerTimeout`.
* Data dependencies are those of stream order: what an A2E of layer L
  returns is computed on the device from what the stage's E2A of the
  previous layer sent, exactly as in the CPU emulation.

Without the comm kernel (no NVRTC and no CuPy, or an NPU) each op is
calibrated device work of the link time (``torch.cuda._sleep``, or scratch
copies), calibrated until the clock settles; the peer and ``comm_cores``
are then not modeled, and the benchmark report says so (its ``comm_model``,
and the reason in its ``fallbacks``, which :func:`build_device_world` also
logs once). The group-order and
stage-protocol checks of the CPU emulation are not made on the device.

Capturable (``WorldSpec.graph``: the runner on upstream's decode graph
path). What a captured step reads and writes lives in static device buffers
of the transport: :meth:`DeviceTransport.begin_step`, on the host side of
every step (before a replay, outside the graph), copies the step's
attention inputs into :attr:`DeviceTransport.step_inputs` and starts the
peer's step (the comm kernel's begin); every E2A writes what it sends into
:attr:`DeviceTransport.sent`, which the next A2E of its stage reads and
:attr:`DeviceTransport.results` snapshots after the step, on the current
stream. Nothing the step issues synchronizes, queries an event, reads a
device tensor on the host or makes a stream or an event (timing events only
while :attr:`DeviceTiming.active`, never during a capture); the peer's
state is read back (:meth:`DeviceTransport.check`) after a synchronize.
On CUDA the runner's ``torch.npu`` calls reach ``torch.cuda`` through
:func:`install_cuda_as_torch_npu` (``torch.npu.NPUGraph`` is
``torch.cuda.CUDAGraph``).

The same world runs on the emulated device (``kind="emulated"``:
:mod:`camp2p_overlap.emulation.device` on the host, the comm kernel's host
reference :class:`HostCommKernels`): there every device op of the world (the
input copies, the comm kernel, the data moves, the FFN, the snapshot) is a
kernel of the emulated device's current stream (``launch``), so it runs in
stream order and a capture records it, and the emulated device enforces the
capture rules (a host read of a buffer a captured kernel writes raises
``CaptureViolation``).

The transport keeps the interface of ``EmulatedTransport`` that the
stand-in connector and ``World`` use: ``a2e``, ``e2a``, ``begin_step`` and
``results``. Importing this module needs only torch; a device is needed
only by :func:`build_device_world`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from camp2p_overlap.core.keys import COMPUTE_STREAM, side_stream_name
from camp2p_overlap.core.log import log_once
from camp2p_overlap.core.observe.trace import TraceOp
from camp2p_overlap.core.overlap.streams import BackendUnavailable, device_module
from camp2p_overlap.emulation import device as emulated_device
from camp2p_overlap.emulation import standins
from camp2p_overlap.emulation.comm_kernel import (
    CommKernels,
    DevicePeerTimeout,
    HostCommKernels,
    NvrtcCommKernels,
)
from camp2p_overlap.emulation.ffn_timing import calibrate_ffn
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

__all__ = [
    "DEVICE_FFN_KERNELS",
    "EMULATED",
    "CommKernels",
    "DeviceDelay",
    "DevicePeerTimeout",
    "DeviceUnavailable",
    "DeviceWorld",
    "HostCommKernels",
    "StaticAttentionInputs",
    "build_device_world",
    "install_cuda_as_torch_npu",
    "is_emulated_device",
    "remove_cuda_as_torch_npu",
    "require_device",
]

#: Stage ids the device transport keeps peer slots for (CAMP2P's groups afd, afd1, afd2).
MAX_STAGE_IDS = 3
#: ``build_device_world``'s kind for the emulated device (on the host).
EMULATED = "emulated"

#: How the world issues one piece of device work: ``launch(kernel, writes)``.
Launch = Callable[[Callable[[], None], Iterable[torch.Tensor]], None]


def is_emulated_device(mod: Any) -> bool:
    """Whether ``mod`` is the emulated device (whose work is host
    functions queued with ``launch``), not a torch device module or a host
    stand-in of one (which runs torch ops where they are called)."""
    return getattr(mod, "launch", None) is emulated_device.launch


def _call(kernel: Callable[[], None], writes: Iterable[torch.Tensor] = ()) -> None:
    kernel()  # torch's own device ops queue themselves on the current stream


def _emulated_launch(kernel: Callable[[], None], writes: Iterable[torch.Tensor] = ()) -> None:
    emulated_device.launch(kernel, writes=tuple(writes))


def launcher(mod: Any) -> Launch:
    """How the world issues device work on ``mod``: on the emulated device
    as a kernel of the current stream (run in stream order, recorded by a
    capture, its ``writes`` kept from host reads while one is in progress);
    elsewhere by calling the torch ops, which a device queues itself."""
    return _emulated_launch if is_emulated_device(mod) else _call


def _stream_key(stream: Any) -> Any:
    """What tells streams apart (``torch.cuda.current_stream()`` makes a
    new object each call; its handle does not change)."""
    for attr in ("cuda_stream", "npu_stream"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    return id(stream)


_NPU_ALIAS_NAME = "camp2p_overlap.emulation.kernel_world.torch_npu_on_cuda"


def install_cuda_as_torch_npu() -> bool:
    """Make ``torch.npu`` an alias of ``torch.cuda`` (``NPUGraph`` is
    ``torch.cuda.CUDAGraph``; every other name is ``torch.cuda``'s) where no
    ``torch.npu`` exists: the stand-in runner's decode graph path calls
    ``torch.npu.graph``, ``NPUGraph``, ``graph_pool_handle``, ``Stream``,
    ``current_stream``, ``stream`` and ``mem_get_info``, as upstream's NPU
    runner does. Returns whether it installed the alias (a real or emulated
    ``torch.npu`` stays as it is)."""
    if getattr(torch, "npu", None) is not None:
        return False
    alias = ModuleType(_NPU_ALIAS_NAME, "torch.cuda under torch.npu's names, for the device world's graph path")

    def __getattr__(name: str) -> Any:
        return getattr(torch.cuda, name)

    alias.__getattr__ = __getattr__  # type: ignore[method-assign]
    alias.NPUGraph = torch.cuda.CUDAGraph  # type: ignore[attr-defined]
    torch.npu = alias  # type: ignore[attr-defined]
    return True


def remove_cuda_as_torch_npu() -> None:
    """Undo :func:`install_cuda_as_torch_npu` (only its alias is removed)."""
    if getattr(getattr(torch, "npu", None), "__name__", None) == _NPU_ALIAS_NAME:
        del torch.npu  # type: ignore[attr-defined]


class DeviceUnavailable(RuntimeError):
    """The requested device cannot be used; the message says why."""


def require_device(kind: str) -> ModuleType:
    """The torch device module for ``--device kind`` (the patch layer's own check,
    :func:`~camp2p_overlap.core.overlap.streams.device_module`), or raise
    :class:`DeviceUnavailable` with its reason, worded for the command line."""
    try:
        return device_module(kind)
    except BackendUnavailable as exc:
        raise DeviceUnavailable(f"--device {kind}: {exc}") from exc


class DeviceDelay:
    """Busy device work of a given duration on the current stream, where no
    comm kernel can be built (:mod:`comm_kernel`): ``torch.cuda._sleep``
    cycles, or repeated copies of a scratch buffer (some torch_npu builds).

    A cycle count is only as good as the clock it was measured at, and the
    SM clock moves between idle and boost (several times): the calibration
    is repeated, with device work in between, until two estimates in a row
    agree within :attr:`SETTLE`, and the settled estimate is used."""

    SETTLE = 0.05
    MAX_ROUNDS = 12

    def __init__(self, mod: ModuleType, device: torch.device) -> None:
        self.mod = mod
        self._sleep = getattr(mod, "_sleep", None)
        self._scratch_src = torch.zeros(1 << 18, device=device)
        self._scratch_dst = torch.empty_like(self._scratch_src)
        self.rounds = 0
        self.settled = False
        self.unit_s = self._calibrate()

    def _unit(self, n: int) -> None:
        if self._sleep is not None:
            self._sleep(n)
        else:
            for _ in range(n):
                self._scratch_dst.copy_(self._scratch_src)

    def _measure(self, n: int) -> float:
        start, end = self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True)
        start.record()
        self._unit(n)
        end.record()
        end.synchronize()
        return max(start.elapsed_time(end) / 1e3, 1e-9) / n

    def _calibrate(self) -> float:
        """Seconds per unit (one ``_sleep`` cycle, or one scratch copy)."""
        n = 2_000_000 if self._sleep is not None else 200
        self._unit(n // 4)  # warm-up
        self.mod.synchronize()
        prev = self._measure(n)
        for rounds in range(1, self.MAX_ROUNDS + 1):
            self.rounds = rounds
            cur = self._measure(n)
            if abs(cur - prev) <= self.SETTLE * prev:
                self.settled = True
                return cur
            prev = cur
        return prev

    def __call__(self, seconds: float) -> None:
        units = int(seconds / self.unit_s)
        if units > 0:
            self._unit(units)


class DelayCommKernels(CommKernels):
    """The fallback without a comm kernel: each op is :class:`DeviceDelay`
    work of the link time; the attention peer and ``--comm-cores`` are not
    modeled (the report says so)."""

    models_peer = False

    def __init__(self, stages: int, delay: DeviceDelay, why: str) -> None:
        super().__init__(stages, 0)
        self.delay = delay
        self.why = why
        #: The kind of device work each op is (the ``fallbacks`` entry's ``instead``).
        self.method = "torch.cuda._sleep" if delay._sleep is not None else "scratch copies"
        self.kind = (
            f"{self.method} (calibrated, {'settled' if delay.settled else 'NOT settled'} after {delay.rounds} rounds)"
        )

    def begin(self, st: torch.Tensor, rec: torch.Tensor) -> None:
        return None

    def op(self, st: torch.Tensor, rec: torch.Tensor, *, link_ns: float, **_: Any) -> None:
        self.delay(link_ns / 1e9)


#: Kernels one :meth:`DeviceFFN.compute` issues, whatever the number of
#: experts: 9 for the routing, 5 for the experts (two GEMMs), 4 for the
#: shared expert. A loop over the experts issues 9 + 6 * experts + 4.
DEVICE_FFN_KERNELS = 18


class DeviceFFN(MoEFFN):
    """A MoE block for the device: router, top-k weights applied densely
    (every expert runs on every token, weighted by its routing weight, 0
    outside the top-k), and a shared expert. No host synchronization.
    ``launched`` (the emulated device): the block is one kernel of the
    current stream filling outputs allocated when it is issued (as
    :class:`MoEFFN` on the CPU); else its torch ops run where it is called.

    The experts are batched, as a grouped-GEMM MoE kernel does, so the
    number of kernels per call does not grow with the experts (about
    :data:`DEVICE_FFN_KERNELS`, where a loop over the experts issues 6 per
    expert): one GEMM for every expert's gate/up projection (the weights
    side by side, ``hidden x experts*2*ffn``), SiLU and the gate product on
    the whole block, the routing weights applied to each expert's slice,
    and one GEMM for every expert's down projection that also sums the
    experts (the down weights stacked, ``experts*ffn x hidden``): with
    ``h_e`` expert e's activations and ``w_e`` its routing weights,
    ``sum_e (w_e h_e) D_e = [w_1 h_1 ... w_E h_E] [D_1; ...; D_E]``. On a
    device the FFN's time is then the GEMMs' (device-bound at the GPU
    scenario's size), not the host's launch rate (docs/validation.md)."""

    def __init__(
        self,
        shape: MoEShape,
        *,
        seed: int,
        device: torch.device,
        dtype: torch.dtype = torch.bfloat16,
        launched: bool = False,
    ) -> None:
        super().__init__(shape, seed=seed, device=device, dtype=dtype)
        self.launched = launched
        h, f, e = shape.hidden, shape.ffn, shape.experts
        for wts in self.groups:
            # (experts, hidden, 2*ffn) -> (hidden, experts*2*ffn): expert e's gate/up in columns e*2f..(e+1)*2f.
            wts["gate_up_all"] = wts.pop("gate_up").permute(1, 0, 2).reshape(h, e * 2 * f).contiguous()
            # (experts, ffn, hidden) -> (experts*ffn, hidden): expert e's down in rows e*f..(e+1)*f.
            wts["down_all"] = wts.pop("down").reshape(e * f, h).contiguous()

    def __call__(self, x: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.launched:
            return super().__call__(x, layer_idx)  # a kernel of the emulated device running compute()
        return self.compute(x, layer_idx)

    def combined(self, x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if self.launched:
            return super().combined(x, layer_idx)
        routed, shared = self.compute(x, layer_idx)
        return routed if shared is None else routed + shared

    def compute(self, x: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dense block's arithmetic, run where it is called."""
        wts = self.groups[layer_idx % len(self.groups)]
        tokens, experts, ffn = x.shape[0], self.shape.experts, self.shape.ffn
        probs = torch.softmax((x @ wts["router"]).float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.shape.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        dense = torch.zeros_like(probs).scatter_(1, top_i, top_w).to(x.dtype)
        gate, up = (x @ wts["gate_up_all"]).view(tokens, experts, 2 * ffn).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up  # (tokens, experts, ffn)
        act.mul_(dense.unsqueeze(-1))  # each expert's slice by its routing weight (0 outside the top-k)
        routed = act.reshape(tokens, experts * ffn) @ wts["down_all"]
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
    #: Host clock (``time.perf_counter_ns``) right after the start event's
    #: record and right before the end event's: what issuing the op took.
    host_start_ns: int = 0
    host_end_ns: int = 0


class DeviceTiming:
    """Device timing events around each op while :attr:`active`, resolved
    into :class:`TraceOp` (device time, ns from the first event) after a
    synchronize. Stream names: ``C`` for the compute stream, ``K<stage>``
    for any other stream an op of that stage ran on.

    Each op's host span is kept too (the host clock between its two event
    records, i.e. the time its work took to issue): after :meth:`resolve`,
    :attr:`host_spans` holds ``(start_ns, end_ns)`` per returned op, in the
    same order, so a benchmark can compare what the host took to issue an op
    with what the device took to run it (a launch-bound op: about as long)."""

    def __init__(self, mod: ModuleType, compute_stream: Any) -> None:
        self.mod = mod
        self.compute_stream = compute_stream
        self.active = False
        self._pending: list[_Timed] = []
        #: id() of each pending start event -> host clock after its record.
        self._host_start: dict[int, int] = {}
        #: After :meth:`resolve`: (host start, host end) ns of each op it returned.
        self.host_spans: list[tuple[int, int]] = []

    def stream_name(self, stage: int | None) -> str:
        current = self.mod.current_stream()
        if current == self.compute_stream:
            return COMPUTE_STREAM
        name = getattr(current, "name", None)  # the patch layer names its streams: F, or K_s
        return name if isinstance(name, str) and name else side_stream_name(stage)

    def begin(self) -> Any:
        if not self.active:
            return None
        ev = self.mod.Event(enable_timing=True)
        ev.record()
        self._host_start[id(ev)] = time.perf_counter_ns()
        return ev

    def end(self, kind: str, layer: int | None, stage: int | None, start: Any, step: int) -> None:
        if start is None:
            return
        host_end = time.perf_counter_ns()
        host_start = self._host_start.pop(id(start), host_end)
        ev = self.mod.Event(enable_timing=True)
        ev.record()
        self._pending.append(_Timed(kind, layer, stage, self.stream_name(stage), start, ev, step, host_start, host_end))

    def resolve(self) -> list[TraceOp]:
        """Synchronize and turn the recorded events into trace ops."""
        self.mod.synchronize()
        self.host_spans = [(t.host_start_ns, t.host_end_ns) for t in self._pending]
        self._host_start.clear()
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


class StaticAttentionInputs(AttentionInputs):
    """:class:`AttentionInputs` over the transport's static buffer: entry
    ``i`` is the base activations attention sends at layer position ``i`` of
    this step (:meth:`DeviceTransport.begin_step` copies them in from the
    step's base), so ``hidden(0, i, n, last)`` is ``AttentionInputs.hidden``
    of the step's ``i``-th layer, bit for bit, computed from a buffer that a
    captured graph reads at every replay."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.base = list(buffer.unbind(0))


class DeviceTransport:
    """The ``a2e``/``e2a`` ops as device work on the current stream, with no
    host-side blocking: the comm kernel (:mod:`comm_kernel`) waits for the
    attention peer on the device and spins the link time; then the data
    moves (a device op computed from what the stage's previous E2A sent).
    Same interface as ``EmulatedTransport`` (``a2e``, ``e2a``,
    ``begin_step``, ``results``, ``peer_wait_ns``).

    Capturable: a step reads its attention inputs from :attr:`step_inputs`
    and writes what each E2A sends into :attr:`sent` (static buffers);
    :meth:`begin_step` fills the first on the host side of the step (before
    a replay, outside the graph) and :attr:`results` snapshots the second
    after it. ``launched`` (the emulated device): each piece of device work
    is a kernel of the current stream (:func:`launcher`)."""

    def __init__(
        self,
        *,
        hidden: int,
        link: LinkModel,
        device: torch.device,
        kernels: CommKernels,
        timing: DeviceTiming,
        attn_s: float = 0.0,
        op_timeout_s: float = 30.0,
        max_layers: int = 64,
        seed: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        max_tokens: int = 4096,
        base_pool: int = 4,
        launched: bool = False,
    ) -> None:
        self.hidden = hidden
        self.link = link
        self.device = device
        self.kernels = kernels
        self.timing = timing
        self.mod = timing.mod
        self.launched = launched
        self._launch: Launch = _emulated_launch if launched else _call
        self.attn_s = attn_s if kernels.models_peer else 0.0
        self.op_timeout_s = op_timeout_s
        self.dtype = dtype
        self.step = 0
        self._pos: dict[int, int] = {}
        self._layers: list[int] = []
        self._stages: list[int] = []
        #: id() of each received hidden-states tensor of this step -> its stage (for timing labels).
        self.stage_of: dict[int, int] = {}
        #: The streams this step's A2E/E2A ops were issued on (more than one: the overlap engaged).
        self.op_streams: set[Any] = set()
        self.inputs = AttentionInputs(
            hidden=hidden, max_tokens=max_tokens, seed=seed, pool=base_pool, dtype=dtype, device=device
        )
        self.stages_cap = kernels.stages
        #: Static: per layer position, the base activations attention sends this step (begin_step's copy).
        self.step_inputs = torch.zeros((max_layers, max_tokens, hidden), dtype=dtype, device=device)
        self._static = StaticAttentionInputs(self.step_inputs)
        #: Static: per (layer position, stage), what that E2A sent (the next A2E's input; the results).
        self.sent = torch.zeros((max_layers, self.stages_cap, max_tokens, hidden), dtype=dtype, device=device)
        #: Tokens each (layer, stage)'s E2A sent when it was last issued (a capture's, for its replays).
        self._tokens: dict[tuple[int, int], int] = {}
        #: The peer: per stage, the sequence and device time of its last E2A; a timeout counter.
        self.state = kernels.state(device)
        #: Per (layer position, stage, a2e/e2a): device start, ready (peer wait over) and end, ns.
        self.rec = torch.zeros((max_layers, self.stages_cap, 2, 3), dtype=torch.int64, device=device)
        self._scratch = torch.zeros(3, dtype=torch.int64, device=device)

    def begin_step(self, step: int, layers: Sequence[int], stages: Sequence[int]) -> None:
        """On the host side of the step (before its forward, or before a
        replay, outside the graph): this step's attention inputs into
        :attr:`step_inputs` and the peer's step start, on the current stream."""
        if len(layers) > self.rec.shape[0]:
            raise ValueError(f"the device transport was built for {self.rec.shape[0]} layers, got {len(layers)}")
        bad = [s for s in stages if not 0 <= s < self.stages_cap]
        if bad:
            raise ValueError(f"stage ids {bad} are outside 0..{self.stages_cap - 1}")
        self.step = step
        self.stage_of = {}
        self.op_streams = set()
        self._pos = {L: i for i, L in enumerate(layers)}
        self._layers = list(layers)
        self._stages = list(stages)
        base = self.inputs.base
        picks = [(self.step_inputs[i], base[(L + step) % len(base)]) for i, L in enumerate(layers)]

        def fill() -> None:
            for dst, src in picks:
                dst.copy_(src)

        self._launch(fill, (self.step_inputs,))
        # The peer's step start, on C before the fork.
        self._launch(lambda: self.kernels.begin(self.state, self._scratch), (self.state, self._scratch))

    def _op(self, kind: str, layer: int, stage: int, nbytes: int) -> None:
        i = self._pos[layer]
        a2e = kind == "a2e"
        rec = self.rec[i, stage, 0 if a2e else 1]
        args: dict[str, Any] = {
            "stage": stage,
            "want_seq": i if a2e else -1,
            "set_seq": -1 if a2e else i + 1,
            "attn_ns": self.attn_s * 1e9,
            "link_ns": self.link.seconds(nbytes) * 1e9,
            "timeout_ns": self.op_timeout_s * 1e9,
        }
        self._launch(lambda: self.kernels.op(self.state, rec, **args), (self.state, self.rec))

    def a2e(
        self, *, group: str, stage: int, layer: int, num_tokens: int, max_num_tokens: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.timing.begin()
        n = int(num_tokens)
        i = self._pos[layer]
        self.op_streams.add(_stream_key(self.mod.current_stream()))
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self._op("a2e", layer, stage, n * self.hidden * itemsize)
        # What the stage's previous E2A of this step sent (None at the first layer).
        last = self.sent[i - 1, stage, :n] if i > 0 else None
        # Allocated on the current (side) stream: the data moved.
        if self.launched:
            hidden = torch.full((n, self.hidden), float("nan"), dtype=self.dtype, device=self.device)
            self._launch(lambda: self._static.hidden(0, i, n, last, out=hidden), (hidden,))
        else:
            hidden = self._static.hidden(0, i, n, last)
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
        i = self._pos[layer]
        n = int(routed.shape[0])
        self.op_streams.add(_stream_key(self.mod.current_stream()))
        nbytes = routed.numel() * routed.element_size()
        if shared is not None:
            nbytes += shared.numel() * shared.element_size()
        dst = self.sent[i, stage, :n]

        def move() -> None:  # the data moved, into the static buffer
            if shared is None:
                dst.copy_(routed)
            else:
                torch.add(routed, shared, out=dst)

        self._launch(move, (dst,))
        self._op("e2a", layer, stage, nbytes)
        self.timing.end("e2a", layer, stage, start, self.step)
        self._tokens[(layer, stage)] = n

    @property
    def results(self) -> dict[tuple[int, int], torch.Tensor]:
        """What attention received for each (layer, stage) of the step:
        a snapshot of :attr:`sent` taken on the current stream (read it
        after a synchronize), each entry as many tokens as its E2A sent when
        it was last issued (for a replay: at its capture). A fresh dict of
        views into one fresh tensor at each read."""
        keys = [(L, s) for L in self._layers for s in self._stages if (L, s) in self._tokens]
        if not keys:
            return {}
        view = self.sent[: len(self._layers), : max(s for _, s in keys) + 1, : max(self._tokens[k] for k in keys)]
        if self.launched:
            snap = torch.empty_like(view)
            self._launch(lambda: snap.copy_(view), (snap,))
        else:
            snap = view.clone()
        return {(L, s): snap[self._pos[L], s, : self._tokens[(L, s)]] for L, s in keys}

    # -- after a synchronize ---------------------------------------------
    def check(self) -> None:
        """Raise :class:`DevicePeerTimeout` if an A2E of the last step gave
        up waiting for its peer. Call after a synchronize."""
        if not self.kernels.models_peer:
            return
        timeouts = int(self.state[-1].item())
        if timeouts:
            raise DevicePeerTimeout(
                f"{timeouts} emulated A2E(s) waited more than {self.op_timeout_s:g} s on the device for their "
                "stage's previous E2A (on hardware this schedule deadlocks)"
            )

    @property
    def peer_wait_ns(self) -> dict[tuple[int, int], int]:
        """Per (layer, stage) of the last step: ns its A2E spent waiting for
        the attention peer on the device (read after a synchronize)."""
        if not self.kernels.models_peer or not self._pos:
            return {}
        rec = self.rec.cpu()
        return {(L, s): int(rec[i, s, 0, 1] - rec[i, s, 0, 0]) for L, i in self._pos.items() for s in self._stages}

    def device_ops(self) -> list[tuple[str, int, int, int, int]]:
        """``(kind, layer, stage, start_ns, end_ns)`` of the last step's comm
        kernels, in the kernels' own device clock (read after a synchronize)."""
        if not self.kernels.models_peer or not self._pos:
            return []
        rec = self.rec.cpu()
        return [
            (kind, L, s, int(rec[i, s, k, 0]), int(rec[i, s, k, 2]))
            for L, i in self._pos.items()
            for s in self._stages
            for k, kind in enumerate(("a2e", "e2a"))
        ]


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
    kernels: CommKernels
    #: Whether :func:`build_device_world` installed the CUDA alias as ``torch.npu`` (:meth:`close` removes it).
    installed_npu_alias: bool = False
    #: What fell back while the world was built, each ``{"what", "reason",
    #: "instead"}`` (logged once each; the benchmark report's ``fallbacks``).
    fallbacks: list[dict[str, str]] = field(default_factory=list)

    @property
    def transport(self) -> DeviceTransport:
        return self.world.transport  # type: ignore[return-value]

    @property
    def kind(self) -> str:
        """``emulated`` on the emulated device, else the device's type."""
        return EMULATED if self.transport.launched else self.device.type

    def synchronize(self) -> None:
        """Wait for the device, then raise if an A2E gave up on its peer."""
        self.mod.synchronize()
        self.transport.check()

    def close(self) -> None:
        """Remove the ``torch.npu`` that :func:`build_device_world` installed
        (the emulated device, or the CUDA alias), if any."""
        self.world.close()
        if self.installed_npu_alias:
            self.installed_npu_alias = False
            remove_cuda_as_torch_npu()


def fallback(what: str, reason: str, instead: str) -> dict[str, str]:
    """A fallback's record (``{"what", "reason", "instead"}``), logged once
    with the package logger."""
    log_once(
        logging.WARNING,
        "device-world-fallback",
        "camp2p-overlap: %s is not used (%s); the device world runs %s instead",
        what,
        reason,
        instead,
    )
    return {"what": what, "reason": reason, "instead": instead}


def comm_kernels(
    mod: ModuleType, kind: str, device: torch.device, stages: int, comm_cores: int, modelled: bool = False
) -> tuple[CommKernels, str | None]:
    """The comm kernel for ``kind``, and why a fallback was taken (None if
    not): on CUDA the NVRTC kernel; on the emulated device its host
    reference, as kernels of the streams; otherwise, or if it cannot be
    built, :class:`DelayCommKernels` (no peer model, no ``--comm-cores``)."""
    why = None
    if kind == EMULATED:
        if comm_cores:
            raise DeviceUnavailable(
                f"--comm-cores {comm_cores} needs the CUDA comm kernel: the emulated device world runs the "
                "kernel's host reference, which holds no cores"
            )
        host = HostCommKernels(stages, modelled=modelled)
        host.kind = "host reference (kernels of the emulated device's streams)" + (
            ", on the modelled timeline" if modelled else ""
        )
        return host, None
    if kind == "cuda":
        try:
            return NvrtcCommKernels(stages, comm_cores, device), None
        except ValueError as exc:  # --comm-cores this GPU cannot give
            raise DeviceUnavailable(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - reported, then the fallback
            why = str(exc)
    else:
        why = f"no comm kernel for {kind}: the attention peer and --comm-cores are not modeled there"
    if comm_cores:
        raise DeviceUnavailable(f"--comm-cores {comm_cores} needs the CUDA comm kernel: {why}")
    return DelayCommKernels(stages, DeviceDelay(mod, device), why), why


def build_device_world(
    spec: WorldSpec,
    kind: str,
    *,
    root: str = standins.REAL_ROOT,
    module: ModuleType | None = None,
    kernels: CommKernels | None = None,
    device: torch.device | None = None,
) -> DeviceWorld:
    """Build the emulated FFN rank on device ``kind`` (``cuda``, ``npu``, or
    ``emulated``: the emulated device on the host, the code path of a device
    run on the CPU). ``module``, ``kernels`` and ``device`` replace the
    torch device module, the comm kernel and the device (tests drive the
    world through a host stand-in of a device module with
    :class:`HostCommKernels`). ``spec.graph``: the runner on upstream's
    decode graph path, with ``torch.npu`` what its graph calls reach (the
    emulated device, or on CUDA :func:`install_cuda_as_torch_npu`);
    :meth:`DeviceWorld.close` removes what was installed."""
    if kind == EMULATED:
        mod = module if module is not None else emulated_device  # type: ignore[assignment]
        device = device if device is not None else torch.device("cpu")
    else:
        mod = module if module is not None else require_device(kind)
    if device is None:
        device = torch.device(kind, mod.current_device())
    launched = is_emulated_device(mod)
    modelled = spec.timing == "model"
    if modelled and not launched:
        raise ValueError("WorldSpec.timing 'model' is for the emulated device: a device's kernels take device time")
    installed_npu = installed_alias = False
    if spec.graph and launched and not emulated_device.is_torch_npu():
        emulated_device.as_torch_npu()  # before the runner: it takes its graph pool from torch.npu
        installed_npu = True
    elif spec.graph and kind == "cuda" and module is None:
        installed_alias = install_cuda_as_torch_npu()
    try:
        standins.install(root)
        runner_mod, conn_mod, meta_mod = standins.import_standins(root)
        max_tokens = max(spec.tokens, 1)
        timing = DeviceTiming(mod, mod.current_stream())
        stages_cap = max(max(spec.stage_ids, default=0) + 1, MAX_STAGE_IDS)
        fell_back: list[dict[str, str]] = []
        if kernels is None:
            kernels, why = comm_kernels(mod, kind, device, stages_cap, spec.comm_cores, modelled)
            if why is not None:
                method = getattr(kernels, "method", kernels.kind)
                instead = f"calibrated {method} of the link time (the attention peer and --comm-cores not modeled)"
                fell_back.append(fallback("the emulated CAM comm kernel", why, instead))
        fell_back[:0] = getattr(kernels, "fallbacks", [])
        transport = DeviceTransport(
            hidden=spec.shape.hidden,
            link=spec.link,
            device=device,
            kernels=kernels,
            timing=timing,
            attn_s=spec.attn_s,
            op_timeout_s=spec.op_timeout_s,
            max_layers=max(spec.layers, 1),
            seed=spec.seed,
            max_tokens=max_tokens,
            launched=launched,
        )
        connector = conn_mod.CAMP2pAFDConnector(transport, hidden_size=spec.shape.hidden)
        ffn = DeviceFFN(spec.shape, seed=spec.seed, device=device, launched=launched)
        if modelled:
            ffn.timing = calibrate_ffn(ffn, [spec.tokens])
        model = TimedModel(
            ffn,
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
            use_aclgraph=spec.graph,
        )
    except BaseException:
        if installed_npu:
            emulated_device.remove_torch_npu()
        if installed_alias:
            remove_cuda_as_torch_npu()
        raise
    world = World(
        spec,
        runner,
        connector,
        transport,  # type: ignore[arg-type]
        (runner_mod, conn_mod, meta_mod),
        installed_torch_npu=installed_npu,
    )
    return DeviceWorld(world, mod, timing, device, kernels, installed_npu_alias=installed_alias, fallbacks=fell_back)
