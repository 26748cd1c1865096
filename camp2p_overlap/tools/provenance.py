"""What every JSON report of ``bench``, ``sweep`` and ``overhead`` records of
how it was made, so that a figure quoted from it can name its run
(docs/benchmark.md, "Where the figures come from"):

- ``run``: ``command`` (the command line as run), ``commit`` (the code it
  ran: ``git rev-parse --short HEAD`` of the package's checkout, ``+`` when
  the tracked files differed from it; null outside a git checkout) and
  ``date`` (UTC, ISO 8601, when the run started);
- ``env``: the machine (``cpu_count``, ``machine``), ``python``, ``torch``,
  ``torch_threads`` and the run's ``switch_interval_s``.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

#: The checkout the package runs from (its parent folder), if it is one.
_CHECKOUT = Path(__file__).resolve().parents[2]


def report_env(torch_threads: int | None = None) -> dict[str, Any]:
    """The machine and interpreter a report ran on; ``torch_threads``:
    what the run set (default: torch's current setting)."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads() if torch_threads is None else torch_threads,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "switch_interval_s": round(sys.getswitchinterval(), 9),
    }


def code_commit(checkout: Path = _CHECKOUT) -> str | None:
    """The short commit of ``checkout`` with ``+`` when its tracked files
    differ from it; None when it is not a git checkout (an installed wheel)."""
    if not (checkout / ".git").exists():
        return None

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return head + ("+" if dirty else "")


def run_record(argv: Sequence[str], *, started: datetime | None = None) -> dict[str, Any]:
    """The ``run`` entry of a report: ``camp2p-overlap`` and ``argv`` as
    one shell command, the code's commit and the start date."""
    when = (started or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return {
        "command": shlex.join(["camp2p-overlap", *argv]),
        "commit": code_commit(),
        "date": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
