"""The emulated CAM communication kernel on a device, and its attention peer.

One kernel plays every A2E and E2A of the device emulation
(:mod:`camp2p_overlap.emulation.kernel_world`). It spins on the device's
wall clock (``%globaltimer``, nanoseconds), never on a calibrated cycle
count, so SM clock changes (idle to boost is several times) do not change
its duration. It runs as ``blocks`` thread blocks; with ``comm_cores = N >=
1`` it launches N blocks that each ask for (nearly) all of an SM's shared
memory, so each holds one SM of its own and no FFN block (which needs shared
memory) can share it while the op waits and moves data: CAM's ``a2e``/
``e2a`` spinning on ``aiv_num`` vector cores beside the MoE kernels. With
``comm_cores = 0`` it is one block of one warp and no shared memory (the
smallest footprint a kernel can have).

The attention peer lives in a small device buffer, per stage: the sequence
number of the stage's last finished E2A and the device time it finished.
An A2E of the stage's i-th layer in the step spins until the E2A of layer
i-1 has finished and then until that finish time plus the attention time
has passed (the first layer: the step's start plus the attention time),
then spins the link time. So the dependency cycle of the CPU world (next
A2E after the previous E2A plus attention) holds on the device, and the wait
happens there, holding the op's SMs. An A2E that waits longer than the op
timeout (a schedule that would deadlock on hardware: an A2E queued before
the E2A it needs, on one stream) gives up, and raises a flag the host reads
after the step (:class:`DevicePeerTimeout`).

:class:`HostCommKernels` runs the same semantics on the host: the executable
reference for the kernel, how CPU-only tests drive the device world through
a host stand-in of a device module, and the comm kernel of the device world
on the emulated device (``bench --device cpu --device-world``).
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

import torch

from camp2p_overlap.core.log import log_once
from camp2p_overlap.emulation.device import hold_until, kernel_start_ns

#: Per stage: [sequence, finish time ns]; then one timeout counter.
SLOTS_PER_STAGE = 2

KERNEL_NAME = "camp2p_comm"

KERNEL_SOURCE = r"""
__device__ __forceinline__ unsigned long long camp2p_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

extern "C" __global__ void camp2p_comm(long long* st, long long* rec, int mode, int stage, int want_seq,
                                       int set_seq, double attn_ns, double link_ns, double timeout_ns,
                                       int nstages, int record_sm) {
    // Dynamic shared memory (the launch's size) is held by the block until
    // it exits; it is never touched.
    if (threadIdx.x != 0) return;
    if (record_sm) {  // tests: which SM each block runs on
        unsigned int sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        rec[3 + blockIdx.x] = (long long)sm;
    }
    volatile long long* v = st;
    unsigned long long t0 = camp2p_now();
    if (mode == 0) {  // step begins: every stage's peer starts its attention now
        if (blockIdx.x == 0) {
            for (int s = 0; s < nstages; ++s) {
                v[2 * s + 1] = (long long)t0;
                __threadfence();
                v[2 * s] = 0;
            }
            v[2 * nstages] = 0;
            __threadfence();
        }
        return;
    }
    unsigned long long ready = t0;
    if (want_seq >= 0) {  // an A2E: wait for the stage's previous E2A plus attention
        bool ok = false;
        unsigned long long now = t0;
        while ((double)(now - t0) < timeout_ns) {
            if (v[2 * stage] >= want_seq) {
                __threadfence();
                long long due = v[2 * stage + 1] + (long long)attn_ns;
                if ((long long)now >= due) { ok = true; break; }
            }
            now = camp2p_now();
        }
        ready = camp2p_now();
        if (!ok && blockIdx.x == 0) atomicAdd((unsigned long long*)(st + 2 * nstages), 1ULL);
    }
    while ((double)(camp2p_now() - ready) < link_ns) {
    }
    if (blockIdx.x == 0) {
        unsigned long long end = camp2p_now();
        rec[0] = (long long)t0;
        rec[1] = (long long)ready;
        rec[2] = (long long)end;
        if (set_seq >= 0) {  // an E2A: the peer has the data now
            v[2 * stage + 1] = (long long)end;
            __threadfence();
            v[2 * stage] = set_seq;
            __threadfence();
        }
    }
}
"""


#: Compiled kernels per (device index, shared memory): one NVRTC compile per process.
_COMPILED: dict[tuple[int, int], Any] = {}


class DevicePeerTimeout(TimeoutError):
    """An emulated A2E on the device waited longer than the op timeout for
    its stage's previous E2A (on hardware: a deadlock)."""


class CommKernels:
    """What the device transport launches on the current stream."""

    #: How the kernel runs, for the report.
    kind = "abstract"
    #: Whether the attention peer is modeled on the device.
    models_peer = True

    def __init__(self, stages: int, comm_cores: int) -> None:
        self.stages = stages
        self.comm_cores = comm_cores
        #: What was tried and failed before this kernel was taken, each
        #: ``{"what", "reason"}`` (the benchmark report's ``fallbacks``).
        self.fallbacks: list[dict[str, str]] = []

    def state(self, device: Any) -> torch.Tensor:
        """The peer buffer (per stage: sequence, finish time; a timeout counter)."""
        return torch.zeros(SLOTS_PER_STAGE * self.stages + 1, dtype=torch.int64, device=device)

    def begin(self, st: torch.Tensor, rec: torch.Tensor) -> None:
        raise NotImplementedError

    def op(
        self,
        st: torch.Tensor,
        rec: torch.Tensor,
        *,
        stage: int,
        want_seq: int,
        set_seq: int,
        attn_ns: float,
        link_ns: float,
        timeout_ns: float,
    ) -> None:
        raise NotImplementedError


class NvrtcCommKernels(CommKernels):
    """:data:`KERNEL_SOURCE` compiled with NVRTC through torch
    (``torch.cuda._compile_kernel``, torch >= 2.8) or, failing that, CuPy."""

    def __init__(self, stages: int, comm_cores: int, device: torch.device) -> None:
        super().__init__(stages, comm_cores)
        self.device = device
        props = torch.cuda.get_device_properties(device)
        sms = int(props.multi_processor_count)
        if comm_cores >= sms:
            raise ValueError(f"--comm-cores {comm_cores}: the GPU has {sms} SMs; leave at least one to the FFN")
        self.sms = sms
        self.blocks = max(1, comm_cores)
        # A block asking for all the shared memory one block may have cannot
        # share its SM with another block that needs shared memory.
        index = device.index if device.index is not None else torch.cuda.current_device()
        optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 0) or _driver_attribute(index, 97)
        per_sm = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0) or _driver_attribute(index, 81)
        if comm_cores > 0 and not (optin and per_sm and 2 * optin > per_sm):
            raise ValueError(
                f"--comm-cores {comm_cores}: cannot hold whole SMs on this GPU (shared memory per block opt-in "
                f"{optin} B, per SM {per_sm} B: one block must take more than half of an SM)"
            )
        self.shared = optin if comm_cores > 0 else 0
        self.threads = 32
        self._launch: Any = None
        self._build()

    def selftest(self) -> None:
        """Run the peer cycle once on stage 0 and read it back: an E2A, then
        an A2E that must end no earlier than the E2A's end plus attention
        plus link. Raises RuntimeError if the kernel does not behave (the
        caller then falls back and reports why)."""
        st = torch.zeros(SLOTS_PER_STAGE * self.stages + 1, dtype=torch.int64, device=self.device)
        rec = torch.zeros((2, 3), dtype=torch.int64, device=self.device)
        attn, link = 50_000.0, 20_000.0
        self.begin(st, rec[0])
        self.op(st, rec[0], stage=0, want_seq=-1, set_seq=1, attn_ns=0.0, link_ns=link, timeout_ns=1e9)
        self.op(st, rec[1], stage=0, want_seq=1, set_seq=-1, attn_ns=attn, link_ns=link, timeout_ns=1e9)
        torch.cuda.synchronize()
        got_st, got_rec = st.tolist(), rec.tolist()
        e_end, a_end = got_rec[0][2], got_rec[1][2]
        problems = []
        if got_st[0] != 1 or got_st[1] != e_end:
            problems.append(f"E2A did not publish its sequence/time: state {got_st}, e2a {got_rec[0]}")
        if got_st[-1] != 0:
            problems.append("the A2E timed out")
        if a_end < e_end + attn + link:
            problems.append(f"A2E ended {a_end - e_end} ns after its E2A, less than attention + link")
        if got_rec[0][2] - got_rec[0][1] < link:
            problems.append("the E2A spun less than its link time")
        if problems:
            raise RuntimeError("comm kernel self-test failed: " + "; ".join(problems))

    def _build(self) -> None:
        """Take the first way of launching the kernel that builds and passes
        :meth:`selftest`: torch's NVRTC wrapper, then CuPy's. Each way that
        failed before the one taken is kept in :attr:`fallbacks` (what, and
        why) and logged once."""
        errors = []
        for kind, make in (
            ("nvrtc (torch.cuda._compile_kernel)", self._torch_launcher),
            ("nvrtc (cupy.RawKernel)", self._cupy_launcher),
        ):
            try:
                self._launch = make()
                self.selftest()
            except Exception as exc:  # noqa: BLE001 - try the next way, report all
                errors.append((kind, f"{type(exc).__name__}: {exc}"))
                continue
            self.kind = kind
            for what, why in errors:
                self.fallbacks.append({"what": f"comm kernel launcher {what}", "reason": why, "instead": kind})
                log_once(
                    logging.WARNING,
                    "comm-kernel-fallback",
                    "camp2p-overlap: the comm kernel launcher %s failed (%s); took %s",
                    what,
                    why,
                    kind,
                )
            return
        raise RuntimeError("cannot build the emulated comm kernel: " + "; ".join(f"{k}: {w}" for k, w in errors))

    def _torch_launcher(self) -> Any:
        compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
        if compile_kernel is None:
            raise RuntimeError(f"torch {torch.__version__} has no torch.cuda._compile_kernel")
        key = (torch.cuda.current_device(), self.shared)
        kernel = _COMPILED.get(key)
        if kernel is None:
            kernel = compile_kernel(KERNEL_SOURCE, KERNEL_NAME)
            if self.shared >= 48 * 1024:
                _allow_shared(kernel, self.shared)
            _COMPILED[key] = kernel

        def launch(args: list[Any]) -> None:
            kernel(grid=(self.blocks, 1, 1), block=(self.threads, 1, 1), args=args, shared_mem=self.shared)

        return launch

    def _cupy_launcher(self) -> Any:
        import cupy  # type: ignore[import-not-found]
        import numpy as np

        kernel = cupy.RawKernel(KERNEL_SOURCE, KERNEL_NAME)
        if self.shared >= 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = self.shared

        def launch(args: list[Any]) -> None:
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            conv = [
                np.uint64(a.data_ptr())
                if isinstance(a, torch.Tensor)
                else (np.int32(a) if isinstance(a, int) else np.float64(a))
                for a in args
            ]
            with stream:
                kernel((self.blocks,), (self.threads,), tuple(conv), shared_mem=self.shared)

        return launch

    def begin(self, st: torch.Tensor, rec: torch.Tensor) -> None:
        self._launch([st, rec, 0, 0, -1, -1, 0.0, 0.0, 0.0, self.stages, 0])

    def op(
        self,
        st: torch.Tensor,
        rec: torch.Tensor,
        *,
        stage: int,
        want_seq: int,
        set_seq: int,
        attn_ns: float,
        link_ns: float,
        timeout_ns: float,
        record_sm: bool = False,
    ) -> None:
        """One A2E (``want_seq >= 0``) or E2A (``set_seq >= 0``) on the
        current stream. ``record_sm`` (tests): ``rec`` has ``3 + blocks``
        slots and each block writes the SM it ran on after the first three."""
        args = [st, rec, 1, stage, want_seq, set_seq, float(attn_ns), float(link_ns), float(timeout_ns)]
        self._launch([*args, self.stages, int(record_sm)])


def _driver_attribute(device_index: int, attribute: int) -> int:
    """``cuDeviceGetAttribute`` through the driver library (0 if unavailable):
    97 is the shared memory a block may opt in to, 81 the shared memory per SM
    (some torch builds do not expose the first in device properties)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), device_index) != 0:
            return 0
        if lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev) != 0:
            return 0
        return int(value.value)
    except (OSError, AttributeError):
        return 0


def _allow_shared(kernel: Any, nbytes: int) -> None:
    """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory (above
    the 48 KiB default): torch's own setter where it knows the device's
    limit, else the driver call it makes, done here."""
    try:
        kernel.set_shared_memory_config(nbytes)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = ctypes.CDLL("libcuda.so.1")
    max_dynamic_shared_size = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    rc = lib.cuFuncSetAttribute(kernel.func, max_dynamic_shared_size, nbytes)
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(max dynamic shared memory = {nbytes}) failed with {rc}")
    kernel._max_shared_mem_bytes = nbytes


class HostCommKernels(CommKernels):
    """The kernel's semantics on the host: ``time.perf_counter_ns`` is the
    device clock, the state buffer a CPU tensor. Waiting sleeps in small
    steps. ``modelled`` (the emulated device's modelled timeline,
    ``WorldSpec.timing = "model"``): an op starts at its kernel's modelled
    start, its peer answers ``attn_ns`` after the previous E2A's modelled
    end (never sooner after that E2A really began), and it holds its stream
    until its modelled end, the link time after both. Called when enqueued with a host stand-in device (which runs work
    at once); on the emulated device the device world launches each call as
    a kernel of the current stream (``kernel_world.launcher``), so it runs in
    stream order, concurrently across streams as a device kernel does, and a
    graph capture records it."""

    kind = "host reference"

    def __init__(self, stages: int, comm_cores: int = 0, modelled: bool = False) -> None:
        super().__init__(stages, comm_cores)
        self.modelled = modelled

    def begin(self, st: torch.Tensor, rec: torch.Tensor) -> None:
        now = time.perf_counter_ns()
        for s in range(self.stages):
            st[2 * s + 1] = now
            st[2 * s] = 0
        st[2 * self.stages] = 0

    def op(
        self,
        st: torch.Tensor,
        rec: torch.Tensor,
        *,
        stage: int,
        want_seq: int,
        set_seq: int,
        attn_ns: float,
        link_ns: float,
        timeout_ns: float,
    ) -> None:
        if self.modelled:
            self._modelled_op(st, rec, stage, want_seq, set_seq, attn_ns, link_ns, timeout_ns)
            return
        t0 = time.perf_counter_ns()
        ready = t0
        if want_seq >= 0:
            ok = False
            while time.perf_counter_ns() - t0 < timeout_ns:
                if int(st[2 * stage]) >= want_seq and time.perf_counter_ns() >= int(st[2 * stage + 1]) + attn_ns:
                    ok = True
                    break
                time.sleep(20e-6)
            ready = time.perf_counter_ns()
            if not ok:
                st[2 * self.stages] += 1
        left = link_ns - (time.perf_counter_ns() - ready)
        if left > 0:
            time.sleep(left / 1e9)
        end = time.perf_counter_ns()
        rec[0], rec[1], rec[2] = t0, ready, end
        if set_seq >= 0:
            st[2 * stage + 1] = end
            st[2 * stage] = set_seq

    def _modelled_op(
        self,
        st: torch.Tensor,
        rec: torch.Tensor,
        stage: int,
        want_seq: int,
        set_seq: int,
        attn_ns: float,
        link_ns: float,
        timeout_ns: float,
    ) -> None:
        t0 = kernel_start_ns()
        began = time.perf_counter_ns()
        ready = t0
        if want_seq >= 0:
            while int(st[2 * stage]) < want_seq and time.perf_counter_ns() - began < timeout_ns:
                time.sleep(20e-6)
            if int(st[2 * stage]) >= want_seq:
                ready = max(t0, int(st[2 * stage + 1]) + round(attn_ns))
            else:
                ready = time.perf_counter_ns()
                st[2 * self.stages] += 1
        end = ready + round(link_ns)
        hold_until(end, "a2e" if want_seq >= 0 else "e2a")
        rec[0], rec[1], rec[2] = t0, ready, end
        if set_seq >= 0:  # the peer answers from the modelled end, never before this E2A really began
            st[2 * stage + 1] = max(end, began)
            st[2 * stage] = set_seq
