"""Child of tests/emulation/test_exit.py: host code on the emulated device
that ends (or raises) with work still on its streams and no synchronize.
The first argument picks the case; the process must end with the status
its host code gave (0, 1 with the traceback last, or ``sys.exit``'s), within
the device's exit bound, with no ``terminate called``. What the host and
the kernels did is printed (unbuffered writes: a kernel runs on a worker
thread) for the parent to check.

* ``launch``: one torch kernel launched; the script ends once it has started;
* ``raise``: an FFN loop (the emulation's MoE FFN, a kernel per layer) whose
  host-side comm op raises at layer 5 with the FFNs still queued;
* ``running``: a kernel still running at exit (it sleeps 0.2 s, then does
  torch work and writes ``kernel finished``), one queued behind it;
* ``blocked``: a kernel that never ends (blocked on a ``threading.Event``
  nobody sets), one queued behind it;
* ``spinning``: a kernel that never ends, running torch ops in a loop;
* ``waiting``: a stream held by a wait on a record queued behind a
  running kernel (dropped at exit, so it never fires), a kernel queued
  behind the wait; the host calls the exit hook itself and prints whether
  every worker thread ended;
* ``nondaemon``: a non-daemon host thread launches and synchronizes after
  the main thread has ended;
* ``exit3``: ``sys.exit(3)`` with a kernel running and one queued;
* ``fork``: the parent forks with a stream blocked and work queued, and
  another thread holding the device's locks; the child launches torch
  kernels on its fresh default stream, synchronizes once, and ends with a
  kernel queued, without a synchronize (the parent prints its status).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import weakref

import torch

from camp2p_overlap.emulation import device as dev
from camp2p_overlap.emulation.device import worker
from camp2p_overlap.emulation.moe import MoEFFN, MoEShape


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def torch_work(x: torch.Tensor, n: int = 20) -> None:
    for _ in range(n):
        torch.matmul(x, x, out=x).div_(x.norm() + 1.0)


def case_launch() -> None:
    x = torch.randn(256, 256)
    started = threading.Event()
    dev.launch(lambda: (started.set(), torch_work(x, 50)))
    started.wait(10)  # the script ends with the kernel inside torch calls
    say("host done")


def case_raise() -> None:
    ffn = MoEFFN(MoEShape(hidden=512, ffn=1024), seed=0)
    x = torch.randn(128, 512)

    def comm_op(layer: int) -> None:
        time.sleep(0.005)  # the host waits on its peer meanwhile: the stream gets going
        if layer == 5:
            raise RuntimeError(f"comm op failed at layer {layer}")

    for layer in range(8):
        routed, shared = ffn(x, layer)
        comm_op(layer)
        x = routed if shared is None else shared


def case_running() -> None:
    x = torch.randn(128, 128)

    def kernel() -> None:
        time.sleep(0.2)
        torch_work(x)
        say("kernel finished")

    started = threading.Event()
    dev.launch(started.set)
    dev.launch(kernel)
    dev.launch(lambda: say("queued kernel ran"))
    started.wait(10)
    say("host done")


def case_blocked() -> None:
    never = threading.Event()
    started = threading.Event()
    dev.launch(lambda: (started.set(), never.wait()))
    dev.launch(lambda: say("queued kernel ran"))
    started.wait(10)
    say("host done")


def case_spinning() -> None:
    x = torch.randn(64, 64)
    started = threading.Event()

    def kernel() -> None:
        started.set()
        while True:
            torch_work(x, 1)

    dev.launch(kernel)
    dev.launch(lambda: say("queued kernel ran"))
    started.wait(10)
    say("host done")


def case_waiting() -> None:
    busy, held = dev.Stream(), dev.Stream()
    started = threading.Event()
    with dev.stream(busy):
        dev.launch(lambda: (started.set(), time.sleep(0.3)))
    dropped = busy.record_event()  # dropped at exit: it never fires
    held.wait_event(dropped)
    with dev.stream(held):
        dev.launch(lambda: say("kernel behind the wait ran"))
    started.wait(10)
    say("host done")
    # What the exit hook does, called here to print what it reports.
    ended = worker.shut_down()
    say(f"every worker ended: {ended}")
    try:
        dropped.synchronize()
    except RuntimeError as exc:
        say(f"synchronize of a dropped record: {exc}")
    try:
        dev.launch(lambda: None)
    except RuntimeError as exc:
        say(f"launch after exit: {exc}")


def case_nondaemon() -> None:
    """A non-daemon host thread still drives the device when the main
    thread ends: the exit hook runs after threading joined it."""
    x = torch.randn(128, 128)

    def host_thread() -> None:
        time.sleep(0.3)
        dev.launch(lambda: torch_work(x))
        dev.synchronize()
        say("host thread synchronized")

    threading.Thread(target=host_thread, daemon=False).start()
    say("main done")


def case_exit3() -> None:
    x = torch.randn(128, 128)
    started = threading.Event()
    dev.launch(lambda: (started.set(), time.sleep(0.1), torch_work(x)))
    dev.launch(lambda: say("queued kernel ran"))
    started.wait(10)
    say("host done")
    sys.exit(3)


def case_fork() -> None:
    side = dev.Stream()
    gate = threading.Event()
    held = torch.ones(8)
    ref = weakref.ref(held)
    with dev.stream(side):
        dev.launch(lambda: gate.wait(10) or None)
        dev.launch(lambda held=held: say("queued kernel ran"))
    del held
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:  # another thread holds the device's locks at the fork
        with worker._workers_lock, worker._default_lock:
            holding.set()
            release.wait(10)

    threading.Thread(target=hold).start()
    holding.wait(10)
    assert worker._default[0] is None  # the child makes its default stream under the lock held here
    pid = os.fork()
    if pid == 0:  # the child: ends as a script does (atexit runs), without a synchronize
        gc.collect()
        say("child: inherited work dropped" if ref() is None else "child: inherited work kept")
        x = torch.randn(128, 128)
        dev.launch(lambda: torch_work(x))
        dev.synchronize()
        dev.launch(lambda: torch_work(x))
        say("child done")
        return
    release.set()
    deadline = time.monotonic() + 20
    done, status = os.waitpid(pid, os.WNOHANG)
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
        done, status = os.waitpid(pid, os.WNOHANG)
    if not done:  # hung (on a lock it inherited held, say): no orphan left behind
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        say("child hung")
    say(f"child status {os.waitstatus_to_exitcode(status)}")
    gate.set()
    dev.synchronize()
    say("parent done")


CASES = {
    "launch": case_launch,
    "raise": case_raise,
    "running": case_running,
    "blocked": case_blocked,
    "spinning": case_spinning,
    "waiting": case_waiting,
    "nondaemon": case_nondaemon,
    "exit3": case_exit3,
    "fork": case_fork,
}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
