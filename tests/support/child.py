"""Fresh interpreters for the tests that need one: ``run_program`` runs a
program of ``tests/programs/`` (a real file, linted like the rest), with
its parameters as arguments and environment variables; ``run_cli`` runs
the command-line tool. Both run this venv's interpreter unless told another (the
vLLM 0.26.0 venv's), without the caller's ``VLLM_CAMP2P_*`` variables, with
the checkout on ``PYTHONPATH`` and the checkout as the working folder."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

#: The repository root (the checkout the tests run from).
REPO = Path(__file__).resolve().parents[2]
#: The child-process programs.
PROGRAMS = REPO / "tests" / "programs"
#: The helpers, and the sources of synthetic modules some tests execute.
SUPPORT = REPO / "tests" / "support"
#: The interpreter of each real vLLM release's venv: scripts/setup.sh --test
#: installs vLLM 0.19.1 in .venv (this interpreter) and vLLM 0.26.0 in
#: .venv-vllm026 (one venv holds one vLLM).
VLLM_PYTHONS = {"0.19.1": sys.executable, "0.26.0": str(REPO / ".venv-vllm026" / "bin" / "python")}


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment less ``VLLM_CAMP2P_*``, plus ``env``, with
    ``PYTHONPATH`` the checkout unless ``env`` sets it."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P")}
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", str(REPO))
    return full_env


def run_program(
    name: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    python: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``tests/programs/<name>`` with ``args`` in a fresh interpreter;
    returns the result (stdout/stderr as text). The caller asserts on
    returncode/output."""
    path = PROGRAMS / name
    assert path.is_file(), f"no child program {path}"
    return subprocess.run(
        [python or sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=timeout,
        cwd=str(REPO),
    )


def run_cli(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 120, python: str | None = None
) -> subprocess.CompletedProcess:
    """Run ``camp2p-overlap <argv>`` (``python -m camp2p_overlap.tools.cli``)
    in a fresh interpreter, as :func:`run_program` runs a program."""
    return subprocess.run(
        [python or sys.executable, "-m", "camp2p_overlap.tools.cli", *argv],
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=timeout,
        cwd=str(REPO),
    )


def run_forked(child: Callable[[], int], meanings: Mapping[int, str]) -> None:
    """Run ``child`` in a forked child (left only by ``os._exit``: no pytest machinery there) and assert it exited 0;
    a non-zero code fails with its meaning in ``meanings``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, meanings.get(code, f"the child failed (exit {code})")
