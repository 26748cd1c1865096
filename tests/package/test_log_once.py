"""``log_once``: one record per distinct (key, text), also when the same
call is asked again on every step, for arguments that cannot be hashed,
and again after a reset."""

from __future__ import annotations

import logging

from support.logs import PackageLogs

from camp2p_overlap.core.log import log_once, reset_log_once


def test_each_text_is_logged_once_until_a_reset(logs: PackageLogs) -> None:
    reset_log_once()
    assert log_once(logging.INFO, "k", "running serially: %s", "a") is True
    assert [log_once(logging.INFO, "k", "running serially: %s", "a") for _ in range(3)] == [False] * 3
    assert log_once(logging.INFO, "k", "running serially: %s", "b") is True
    assert log_once(logging.INFO, "other key", "running serially: %s", "a") is True
    assert log_once(logging.INFO, "k", "running serially: a") is False  # the same text, asked another way
    assert log_once(logging.INFO, "k", "groups %s", ["x"]) is True  # an argument that cannot be hashed
    assert log_once(logging.INFO, "k", "groups %s", ["x"]) is False
    assert logs.texts("running serially") == ["running serially: a", "running serially: b", "running serially: a"]
    reset_log_once()
    assert log_once(logging.INFO, "k", "running serially: %s", "a") is True
    assert logs.texts("running serially: a")[-1] == "running serially: a" and len(logs.texts("serially: a")) == 3
