"""A process that used the emulated device exits with the status its host
code gave, whatever its streams still hold: the device's exit hook drops
queued work, lets a running kernel end within its bound (interrupting one
that runs on), and lets go of waits, before the interpreter finalizes (a
worker thread inside a torch call then would abort the process:
``terminate called without an active exception``, status 134). Each case
runs ``tests/programs/emulated_exit.py`` in a fresh interpreter, at
CPython's default thread switching, as a user's script runs."""

from __future__ import annotations

import os
import subprocess

import pytest
from support.child import run_program

#: Generous: the exit hook waits at most EXIT_WAIT_S + EXIT_INTERRUPT_S
#: (1.5 s); a process still running after this never ends on its own.
TIMEOUT_S = 60.0


def run_case(case: str) -> subprocess.CompletedProcess:
    res = run_program("emulated_exit.py", case, timeout=TIMEOUT_S)
    assert "terminate called" not in res.stderr + res.stdout, res.stderr
    return res


def lines(text: str) -> list[str]:
    return text.strip().splitlines()


def test_a_script_that_ends_without_synchronize_exits_0() -> None:
    res = run_case("launch")
    assert res.returncode == 0, res.stderr
    assert lines(res.stdout) == ["host done"]
    assert res.stderr == ""


def test_a_host_error_with_kernels_queued_exits_1_with_the_traceback_last() -> None:
    res = run_case("raise")
    assert res.returncode == 1, res.stderr
    err = lines(res.stderr)
    assert err[0] == "Traceback (most recent call last):"
    assert err[-1] == "RuntimeError: comm op failed at layer 5"


def test_sys_exit_status_is_kept_and_queued_work_dropped() -> None:
    res = run_case("exit3")
    assert res.returncode == 3, res.stderr
    assert lines(res.stdout) == ["host done"]  # the queued kernel never ran
    assert res.stderr == ""


def test_a_kernel_running_at_exit_ends_and_the_work_behind_it_is_dropped() -> None:
    res = run_case("running")
    assert res.returncode == 0, res.stderr
    assert lines(res.stdout) == ["host done", "kernel finished"]
    assert res.stderr == ""


def test_a_kernel_blocked_forever_is_abandoned_and_the_process_exits() -> None:
    res = run_case("blocked")
    assert res.returncode == 0, res.stderr
    assert lines(res.stdout) == ["host done"]
    assert res.stderr == ""


def test_a_kernel_spinning_on_torch_ops_forever_is_interrupted_and_the_process_exits() -> None:
    res = run_case("spinning")
    assert res.returncode == 0, res.stderr
    assert lines(res.stdout) == ["host done"]
    assert res.stderr == ""


def test_a_stream_waiting_on_a_dropped_record_lets_go_at_exit_and_the_device_refuses_work() -> None:
    res = run_case("waiting")
    assert res.returncode == 0, res.stderr
    assert lines(res.stdout) == [
        "host done",
        "every worker ended: True",
        "synchronize of a dropped record: Event.synchronize(): its record was dropped at interpreter exit",
        "launch after exit: the emulated device stopped at interpreter exit: it has no default stream",
    ]
    assert res.stderr == ""


def test_the_exit_hook_runs_after_non_daemon_host_threads_have_ended() -> None:
    res = run_case("nondaemon")
    assert res.returncode == 0, res.stderr
    assert lines(res.stdout) == ["main done", "host thread synchronized"]
    assert res.stderr == ""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_drops_inherited_work_and_exits_with_its_status() -> None:
    """Another thread held the device's locks at the fork: the child's are fresh."""
    res = run_case("fork")
    assert res.returncode == 0, res.stderr
    assert lines(res.stdout) == [
        "child: inherited work dropped",
        "child done",
        "child status 0",
        "queued kernel ran",  # the parent's, once its gate opened
        "parent done",
    ]
    assert res.stderr == ""
