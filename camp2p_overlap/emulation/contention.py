"""Communication that takes compute: the ``--comm-cores N`` model on the CPU.

On an Ascend NPU the CAM ``a2e``/``e2a`` kernels run on ``aiv_num`` vector
cores and spin there while they wait for the peer and while data moves; those
cores are not free for the MoE kernels beside them. The CPU emulation
otherwise spends communication time in ``time.sleep``, which takes no
compute at all. A :class:`CoreSpinner` instead keeps ``N`` cores busy for the
op's whole duration: the calling thread (the side stream's worker, or C on
the serial path) and ``N - 1`` helper threads each run small torch matmuls
(which release the GIL, so the spin competes for cores, not for the
interpreter) until the op is over.

``N = 0`` keeps the old behaviour (sleep). The spin ends on measured wall
time (``time.perf_counter``), never on a calibrated count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

#: Side length of the matmul one spin iteration runs (a short one), so a
#: spin overshoots its end by at most about one iteration.
SPIN_CHUNK = 96
#: How many ops may spin at once (one per stage group, plus C) before a
#: helper must wait for a free thread.
MAX_CONCURRENT_OPS = 4


class CoreSpinner:
    """Busy-waits on ``cores`` CPU cores (threads) for a wall time."""

    def __init__(self, cores: int) -> None:
        if cores < 0:
            raise ValueError(f"comm cores must not be negative, got {cores}")
        self.cores = cores
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        #: Per thread that took part in the last finished spin: its thread CPU
        #: seconds during that spin (tests read it to see each core was busy).
        self.last_thread_cpu_s: list[float] = []

    @property
    def spins(self) -> bool:
        return self.cores > 0

    def _helpers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=max(1, (self.cores - 1) * MAX_CONCURRENT_OPS),
                    thread_name_prefix="camp2p-comm-core",
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def wait(self, seconds: float) -> None:
        """Spend ``seconds`` of wall time: asleep when ``cores`` is 0, else
        busy on ``cores`` cores."""
        if seconds <= 0:
            return
        if not self.spins:
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        self.until(lambda: time.perf_counter() >= deadline, hard_deadline=deadline)

    def until(self, done: Callable[[], bool], *, hard_deadline: float) -> bool:
        """Busy-wait on ``cores`` cores until ``done()`` is true or the wall
        clock passes ``hard_deadline``; returns ``done()``'s last answer.
        ``done`` is polled between spin iterations on the calling thread."""
        stop = threading.Event()
        futures: list[Future[float]] = []
        if self.cores > 1:
            pool = self._helpers()
            futures = [pool.submit(_spin_helper, stop, hard_deadline) for _ in range(self.cores - 1)]
        a, b, c = _operands()
        cpu0 = time.thread_time()
        try:
            while True:
                if done():
                    ok = True
                    break
                if time.perf_counter() >= hard_deadline:
                    ok = done()
                    break
                torch.mm(a, b, out=c)
        finally:
            stop.set()
            mine = time.thread_time() - cpu0
            others = [f.result() for f in futures]
        self.last_thread_cpu_s = [mine, *others]
        return ok


def _operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    local = _LOCAL.__dict__
    ops = local.get("ops")
    if ops is None:
        g = torch.Generator().manual_seed(1)
        a = torch.randn(SPIN_CHUNK, SPIN_CHUNK, generator=g)
        ops = local["ops"] = (a, a.clone(), torch.empty_like(a))
    return ops


_LOCAL = threading.local()


def _spin_helper(stop: threading.Event, hard_deadline: float) -> float:
    a, b, c = _operands()
    cpu0 = time.thread_time()
    while not stop.is_set() and time.perf_counter() < hard_deadline:
        torch.mm(a, b, out=c)
    return time.thread_time() - cpu0
