"""What a report records of its run: the command as run, the commit (``+``
when the tracked files differ from it, null outside a checkout), the date,
and the machine."""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from camp2p_overlap.tools.provenance import code_commit, report_env, run_record


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_the_checkouts_and_marks_a_changed_work_tree(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert code_commit(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("not the code\n")
    assert code_commit(tmp_path) == head, "an untracked file does not change the code"
    (tmp_path / "a.txt").write_text("two\n")
    assert code_commit(tmp_path) == head + "+"


def test_no_commit_outside_a_checkout(tmp_path: Path) -> None:
    assert code_commit(tmp_path) is None


def test_the_run_record_and_the_machine() -> None:
    when = datetime(2026, 12, 2, 10, 31, 5, tzinfo=timezone.utc)
    rec = run_record(["bench", "--scenario", "ffn-bound", "--json", "a b.json"], started=when)
    assert rec["command"] == "camp2p-overlap bench --scenario ffn-bound --json 'a b.json'"
    assert rec["date"] == "2026-12-02T10:31:05Z"
    assert rec["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}\+?", rec["commit"])
    env = report_env(3)
    assert set(env) == {"python", "torch", "torch_threads", "cpu_count", "machine", "switch_interval_s"}
    assert env["torch_threads"] == 3 and isinstance(env["cpu_count"], int)
