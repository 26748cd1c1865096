"""GPU validation of the schedule with real CUDA streams and events (marker
``gpu``; skipped without a CUDA device). Run by ``scripts/gpu_check.sh``.

The emulated FFN rank on the device (``emulation/kernel_world.py``): dense
bf16 MoE compute on the compute stream, A2E/E2A as the emulated CAM kernel
(``emulation/comm_kernel.py``: it waits for the attention peer on the device,
then spins the link time on the device's wall clock) plus a device op for
the data moved, on whatever stream the patch layer puts them. Checked here:

* the overlap's outputs are bitwise those of the serial path;
* the device-time trace shows communication of one stage running while
  another stage's FFN computes (and the serial run shows none);
* the attention peer's cycle holds on the device (a stage's next A2E ends
  after its previous E2A plus the attention time), and an A2E queued ahead
  of the E2A it needs times out on the device and is reported, not hung;
* ``--comm-cores N``: each comm op's N blocks run on N distinct SMs, and two
  ops at once on 2N (each block holds a whole SM's shared memory);
* the stream sanitizer (``TORCH_CUDA_SANITIZER=1``, CSAN) reports no race for
  the overlapped steps, while the same steps with the A2E->FFN edge removed
  do (so the sanitizer run is able to fail). What CSAN checks: for every
  tensor, the reads and writes torch operators make on each stream, against
  the stream waits and event records between them; an access on one stream
  not ordered after a conflicting access on another is a race. What it
  cannot check: it starts a tensor's history afresh at each allocation, so a
  block freed while another stream still reads it, and handed out again by
  the caching allocator, looks like a new tensor to it. That is the
  ownership claim that makes ``record_stream`` unnecessary, and it is tested
  directly below: a side stream is held back so that a dropped reference
  would let the allocator hand the block to the compute stream before the
  side stream read it; the session's ownership keeps outputs bitwise, and a
  session that drops its references (the control) corrupts them;
* the forward captured in a CUDA graph (graph switch on, in-process and
  through ``VLLM_CAMP2P_MULTISTREAM_GRAPH=1`` in a fresh process) replays with
  the outputs of the eager step; with the join removed, capture fails.

Child processes have a time limit of ``CAMP2P_GPU_CHILD_TIMEOUT_S`` (default
60 s) each, so that all of them fit in the script's pytest limit and a slow
run still ends with a JUnit report.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.child import PROGRAMS, REPO
from support.overlap import assert_same

from camp2p_overlap.core.config import OverlapConfig

CHILD_TIMEOUT_S = float(os.environ.get("CAMP2P_GPU_CHILD_TIMEOUT_S", "60"))
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

STAGES = (0, 1, 2)
TOKENS = {0: 256, 1: 192, 2: 128}


def _spec(**kw: Any) -> Any:
    from camp2p_overlap.emulation.moe import MoEShape
    from camp2p_overlap.emulation.world import LinkModel, WorldSpec

    kw.setdefault("layers", 6)
    kw.setdefault("stage_ids", STAGES)
    kw.setdefault("tokens", 256)
    kw.setdefault("shape", MoEShape(hidden=1024, ffn=2048, experts=4, top_k=2))
    kw.setdefault("link", LinkModel(latency_s=200e-6, bandwidth_Bps=20e9))
    kw.setdefault("attn_s", 0.0)
    return WorldSpec(**kw)


@pytest.fixture
def site() -> Iterator[Any]:
    from camp2p_overlap.emulation.standin_patch_layer import release_site, standin_site

    s = standin_site()
    yield s
    release_site(s)


@contextlib.contextmanager
def overlap_on(site: Any, **overrides: Any) -> Iterator[Any]:
    """The patch layer applied for the CUDA backend. The benchmark's engine
    is used so the check does not depend on which vLLM the GPU box has."""
    from camp2p_overlap.emulation.standin_patch_layer import emulation_engine

    overrides.setdefault("adaptive", False)  # every step overlapped: the checks need the overlap to run
    with emulation_engine() as engine:
        cfg = OverlapConfig(enabled=True, backend="cuda", **overrides)
        report = engine.apply(config=cfg, manifest=site.manifest, strict=True)
        assert report.engaged, str(report)
        yield engine


def _step(dw: Any, n: int) -> dict:
    dw.world.steps_run = n - 1
    out = dw.world.run_step(TOKENS)
    dw.synchronize()
    return out


def test_cuda_overlap_is_bitwise_serial_and_the_trace_overlaps(site: Any) -> None:
    from camp2p_overlap.emulation.kernel_world import build_device_world
    from camp2p_overlap.verify.edges import overlaps

    dw = build_device_world(_spec(), "cuda", root=site.root)
    _step(dw, 1)  # warm-up (kernels, allocator)
    dw.timing.active = True
    serial = {n: _step(dw, n) for n in (2, 3, 4)}
    serial_ops = dw.timing.resolve()
    dw.timing.active = False
    with overlap_on(site):
        _step(dw, 1)  # warm-up: creates the side streams outside any capture
        dw.timing.active = True
        got = {n: _step(dw, n) for n in (2, 3, 4)}
        ops = dw.timing.resolve()
        dw.timing.active = False
    for n in serial:
        assert_same(got[n], serial[n], f"step {n}: overlap outputs differ from the serial path")
    assert len(got[2]) == 6 * len(STAGES)

    comm = [o for o in ops if o.kind in ("a2e", "e2a")]
    ffn = [o for o in ops if o.kind == "ffn"]
    assert {o.stream for o in comm} == {f"K{s}" for s in STAGES}
    assert {o.stream for o in ffn} == {"C"}
    hidden = [(c, f) for c in comm for f in ffn if c.step == f.step and c.stage != f.stage and overlaps(c, f)]
    assert hidden, "no A2E/E2A ran on the device while another stage's FFN computed"
    cross = [(a, b) for a in comm for b in comm if a.step == b.step and a.stage < b.stage and overlaps(a, b)]
    assert cross, "no two stages' communication ran at the same time"
    # Control: the serial path runs everything on C, one op after another.
    assert {o.stream for o in serial_ops} == {"C"}
    s_comm = [o for o in serial_ops if o.kind in ("a2e", "e2a")]
    s_ffn = [o for o in serial_ops if o.kind == "ffn"]
    assert not [(c, f) for c in s_comm for f in s_ffn if overlaps(c, f)]


# ---------------------------------------------------------------------------
# subprocess checks (sanitizer, failing capture): a fresh CUDA context each,
# tests/programs/gpu_overlap_child.py in the mode its argv names.
_CHILD = PROGRAMS / "gpu_overlap_child.py"


def _child(
    mode: str, *, sanitizer: bool, timeout: float = CHILD_TIMEOUT_S, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P")}
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    else:
        env.pop("TORCH_CUDA_SANITIZER", None)
    return subprocess.run(
        [sys.executable, str(_CHILD), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(REPO),
    )


def test_cuda_sanitizer_reports_no_race_for_the_overlap() -> None:
    res = _child("ok", sanitizer=True)
    out = res.stdout + res.stderr
    assert "CSAN detected" not in out, out[-4000:]
    assert res.returncode == 0 and "STEPS_DONE ok" in res.stdout, out[-4000:]


def test_cuda_sanitizer_catches_a_missing_edge() -> None:
    """The control: without the FFN's wait on its A2E the sanitizer reports
    a data race, so the clean run above means something."""
    res = _child("race", sanitizer=True)
    out = res.stdout + res.stderr
    assert "CSAN detected a possible data race" in out, out[-4000:]


def test_cuda_graph_capture_replays_the_eager_outputs(site: Any) -> None:
    from camp2p_overlap.emulation.kernel_world import build_device_world

    dw = build_device_world(_spec(layers=4, stage_ids=(0, 1)), "cuda", root=site.root)
    tokens = {0: 256, 1: 160}

    def eager(n: int) -> dict:
        dw.world.steps_run = n - 1
        out = dw.world.run_step(tokens)
        dw.synchronize()
        return out

    serial = eager(5)
    with overlap_on(site, graph=True):
        # Eager warm-up: creates the side streams and events outside capture.
        for _ in range(2):
            assert_same(eager(5), serial)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the usual warm-up on a side stream
            eager(5)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        dw.world.steps_run = 4
        with torch.cuda.graph(g):
            dw.world.run_step(tokens)
        captured = dict(dw.world.transport.results)  # tensors of the graph's pool
        assert captured.keys() == serial.keys()
        for _ in range(3):
            for t in captured.values():
                t.zero_()
            g.replay()
            torch.cuda.synchronize()
            assert_same(captured, serial, "graph replay differs from the eager step")
        # Eager steps still work after capture, with the same outputs.
        assert_same(eager(5), serial)


def test_cuda_graph_capture_fails_when_a_side_stream_is_not_joined() -> None:
    """A/B in one fresh process: the same capture succeeds with the join and
    fails once the join is removed."""
    res = _child("graph-ab", sanitizer=False)
    out = res.stdout + res.stderr
    assert "CAPTURE_WITH_JOIN_OK" in res.stdout, out[-4000:]
    assert "CAPTURE_WITHOUT_JOIN_FAILED" in res.stdout, out[-4000:]
    assert res.returncode == 0, out[-4000:]


def test_cuda_graph_capture_through_the_environment_switch() -> None:
    """``VLLM_CAMP2P_MULTISTREAM_GRAPH=1`` (read from the environment, as in a
    vLLM worker) lets the overlapped step be captured; the graph replays the
    eager serial outputs bitwise."""
    env = {
        "VLLM_CAMP2P_MULTISTREAM": "1",
        "VLLM_CAMP2P_MULTISTREAM_GRAPH": "1",
        "VLLM_CAMP2P_MULTISTREAM_BACKEND": "cuda",
        "VLLM_CAMP2P_MULTISTREAM_ADAPTIVE": "0",
    }
    res = _child("graph-env", sanitizer=False, env_extra=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "GRAPH_ENV_OK" in res.stdout, out[-4000:]


# ---------------------------------------------------------------------------
# the emulated comm kernel and the attention peer on the device


def test_cuda_comm_kernel_holds_n_whole_sms() -> None:
    from camp2p_overlap.emulation.comm_kernel import NvrtcCommKernels

    n = 4
    k = NvrtcCommKernels(3, n, torch.device("cuda", torch.cuda.current_device()))  # runs its self-test
    assert k.kind.startswith("nvrtc"), k.kind
    assert k.blocks == n and k.shared > torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor // 2
    st = k.state("cuda")
    recs = [torch.full((3 + n,), -1, dtype=torch.int64, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for s, rec in zip(streams, recs, strict=True):
        with torch.cuda.stream(s):  # two E2As of different stages at once, 20 ms each
            k.op(st, rec, stage=streams.index(s), want_seq=-1, set_seq=1, attn_ns=0.0, link_ns=20e6, timeout_ns=1e9,
                 record_sm=True)  # fmt: skip
    torch.cuda.synchronize()
    sms = [r[3:].tolist() for r in recs]
    (start0, end0), (start1, end1) = [(r[0].item(), r[2].item()) for r in recs]
    assert all(len(set(x)) == n for x in sms), f"each op's {n} blocks should run on {n} distinct SMs: {sms}"
    # The SM check below proves something only if both ops held their SMs at once.
    assert start0 < end1 and start1 < end0, (
        f"the two 20 ms comm ops on two streams did not run at the same time (device ns: op 0 {start0}..{end0}, "
        f"op 1 {start1}..{end1}), so SM disjointness cannot be checked: concurrent kernels are off here"
    )
    assert not set(sms[0]) & set(sms[1]), f"two comm ops shared an SM while both held it: {sms}"


def _peer_world(site: Any, **kw: Any) -> Any:
    from camp2p_overlap.emulation.kernel_world import build_device_world

    spec = _spec(layers=4, stage_ids=(0, 1), attn_s=kw.pop("attn_s", 300e-6), **kw)
    return build_device_world(spec, "cuda", root=site.root)


def _traced(dw: Any, n: int) -> tuple[list, dict]:
    dw.world.steps_run = n - 1
    dw.timing.active = True
    try:
        start = dw.timing.begin()
        out = dw.world.run_step({0: 256, 1: 192})
        dw.timing.end("step", None, None, start, dw.world.transport.step)
    finally:
        dw.timing.active = False
    ops = dw.timing.resolve()
    dw.synchronize()
    return ops, out


def test_cuda_attention_peer_cycle_holds_on_the_device(site: Any) -> None:
    from camp2p_overlap.verify.peer_cycle import check_peer_cycle

    dw = _peer_world(site, comm_cores=2)
    assert dw.kernels.models_peer, dw.kernels.kind
    layers, stages, attn_ns = (0, 1, 2, 3), (0, 1), 300_000
    _traced(dw, 1)  # warm-up
    serial_ops, serial = _traced(dw, 2)
    waits = dw.transport.peer_wait_ns
    assert len(waits) == 8 and max(waits.values()) >= attn_ns // 2, waits
    assert check_peer_cycle(serial_ops, layers, stages, attn_ns).ok
    with overlap_on(site, adaptive=False):
        _traced(dw, 2)
        ops, got = _traced(dw, 2)
    assert_same(got, serial)
    res = check_peer_cycle(ops, layers, stages, attn_ns)
    assert res.ok, str(res)
    dev = {(kind, L, s): (t0, t1) for kind, L, s, t0, t1 in dw.transport.device_ops()}
    for s in stages:
        for prev, nxt in itertools.pairwise(layers):
            assert dev[("a2e", nxt, s)][1] >= dev[("e2a", prev, s)][1] + attn_ns


def test_cuda_a2e_ahead_of_its_e2a_times_out_instead_of_hanging(site: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from camp2p_overlap.core.overlap.session import StepSession
    from camp2p_overlap.emulation.comm_kernel import DevicePeerTimeout

    dw = _peer_world(site, op_timeout_s=0.2, attn_s=0.0)
    orig_send = StepSession.send

    def send_a2e_first(self: Any, call: Any, output: Any, context: Any, stage: Any) -> None:
        key = self.stage_layer_of(context)
        nxt = None if key is None else self.plan.next_layer(key[0])
        if nxt is None:
            return orig_send(self, call, output, context, stage)
        self.issue_a2e(nxt, key[1])  # the lookahead A2E queued on K_s before its E2A: a deadlock on hardware
        real = self.issue_a2e
        self.issue_a2e = lambda layer, s: None
        try:
            return orig_send(self, call, output, context, stage)
        finally:
            self.issue_a2e = real

    with overlap_on(site, adaptive=False):
        monkeypatch.setattr(StepSession, "send", send_a2e_first)
        with pytest.raises(DevicePeerTimeout):
            _traced(dw, 1)


def _tensors_of(ffn_out: Any) -> list[torch.Tensor]:
    """The tensors an FFN output holds (a tensor, or upstream's payload of
    routed and shared outputs)."""
    if isinstance(ffn_out, torch.Tensor):
        return [ffn_out]
    found = (getattr(ffn_out, name, None) for name in ("routed_output", "shared_output"))
    return [t for t in found if isinstance(t, torch.Tensor)]


def poison_free_blocks(like: torch.Tensor) -> list[tuple[int, int]]:
    """Fill with NaN every free block of the caching allocator on the current
    stream that a tensor like ``like`` fits, then give them back; return the
    (address, bytes) taken. Tensors like ``like`` are taken one by one until
    the allocator reserves more device memory, which it does only once no
    free block of this stream fits the request (best fit over the free
    blocks of the stream's pool; a free block larger than the request is
    split and its rest taken by the next ones, so at most a tail smaller
    than ``like`` of a free region is left). Each request served from the
    cache takes at least ``like``'s bytes of what is cached and free, which
    bounds the loop."""
    nbytes = max(like.numel() * like.element_size(), 1)
    reserved = torch.cuda.memory_reserved()
    bound = (reserved - torch.cuda.memory_allocated()) // nbytes + 2
    junk: list[torch.Tensor] = []
    for _ in range(bound):
        junk.append(torch.full_like(like, float("nan")))
        if torch.cuda.memory_reserved() > reserved:
            break
    else:
        raise AssertionError(
            f"{bound} tensors of {nbytes} bytes did not exhaust the allocator's free blocks "
            "(reserved memory never grew): the poisoning's premise does not hold on this torch"
        )
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in junk]


@pytest.mark.parametrize("drop_refs", [False, True], ids=["session-ownership", "control-refs-dropped"])
def test_cuda_tensor_ownership_without_record_stream(
    site: Any, monkeypatch: pytest.MonkeyPatch, drop_refs: bool
) -> None:
    """FFN outputs are allocated on C and read by E2A on K_s. Each E2A is held
    back on K_s (a long device wait before it reads), and before every FFN
    every free block of the caching allocator on C that an output fits is
    taken, filled with NaN and given back (:func:`poison_free_blocks`): if
    the session let go of an FFN output before C waited for that E2A, its
    block is among them, written before the E2A read it. With the session's
    ownership the outputs stay bitwise; the control drops the references and
    must differ, so the check can fail (and it checks that a sent output's
    block was indeed handed to the poisoning)."""
    import weakref

    from camp2p_overlap.core.overlap.session import StepSession
    from camp2p_overlap.emulation.kernel_world import DeviceTransport, TimedModel, build_device_world
    from camp2p_overlap.emulation.world import LinkModel

    spec = _spec(layers=3, stage_ids=STAGES, attn_s=0.0, link=LinkModel(latency_s=5e-6, bandwidth_Bps=1e12))
    dw = build_device_world(spec, "cuda", root=site.root)
    tokens = dict.fromkeys(STAGES, 256)

    def step(n: int) -> dict:
        dw.world.steps_run = n - 1
        out = dw.world.run_step(tokens)
        dw.synchronize()
        return {k: v.clone() for k, v in out.items()}

    serial = step(1)
    orig_e2a = DeviceTransport.e2a

    def late_e2a(self: Any, **kw: Any) -> None:
        # K_s stalls before the E2A reads the FFN output: 2e8 cycles, about 0.1 s, far longer than the
        # host takes to reach the poisoning before the next FFNs (a few ms each) and C to run it.
        torch.cuda._sleep(200_000_000)
        return orig_e2a(self, **kw)

    monkeypatch.setattr(DeviceTransport, "e2a", late_e2a)
    orig_ffn = TimedModel.compute_ffn_output
    #: (weak reference, address, bytes) of each FFN output tensor of the step.
    outputs: list[tuple[Any, int, int]] = []
    #: Blocks of FFN outputs already freed that the poisoning took; how many blocks it took.
    reused: list[int] = []
    taken = [0]

    def ffn_after_poisoning_free_blocks(self: Any, *, hidden_states: torch.Tensor, layer_idx: int) -> Any:
        freed = [(ptr, size) for ref, ptr, size in outputs if ref() is None]
        blocks = poison_free_blocks(hidden_states)
        taken[0] += len(blocks)
        for ptr, size in blocks:
            reused.extend(p for p, n in freed if ptr < p + n and p < ptr + size)
        out = orig_ffn(self, hidden_states=hidden_states, layer_idx=layer_idx)
        outputs.extend((weakref.ref(t), t.data_ptr(), t.numel() * t.element_size()) for t in _tensors_of(out))
        return out

    monkeypatch.setattr(TimedModel, "compute_ffn_output", ffn_after_poisoning_free_blocks)
    if drop_refs:
        orig_send = StepSession.send

        def send_and_forget(self: Any, call: Any, output: Any, context: Any, stage: Any) -> None:
            orig_send(self, call, output, context, stage)
            self.release_buffers()

        monkeypatch.setattr(StepSession, "send", send_and_forget)
    with overlap_on(site, adaptive=False):
        got = step(1)
    assert outputs, "no FFN output was seen: the check did not run"
    differ = [k for k in serial if not torch.equal(got[k], serial[k])]
    if drop_refs:
        assert reused, (
            f"the control never had a sent FFN output's block handed to the poisoning ({taken[0]} blocks taken "
            f"over {len(outputs)} FFN output tensors): no reference was dropped, or the allocator kept the block"
        )
        assert differ, (
            f"the control (references dropped, {len(set(reused))} freed output blocks poisoned) did not corrupt "
            "any output: the E2A read before C wrote, or the check cannot fail"
        )
    else:
        assert not differ, f"outputs differ from serial at {differ}: a block was reused while K_s still read it"
