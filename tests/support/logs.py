"""Capture of the package logger's records (the ``logs`` fixture's type)."""

from __future__ import annotations

import logging


class PackageLogs(logging.Handler):
    """Every record of the package logger, wherever vLLM's logging config
    (which importing vLLM turns on) would otherwise send them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]

    def matching(self, contains: str = "", level: int = logging.NOTSET) -> list[logging.LogRecord]:
        """The records at ``level`` or above whose message contains ``contains``."""
        return [r for r in self.records if r.levelno >= level and contains in r.getMessage()]

    def texts(self, contains: str = "", level: int = logging.NOTSET) -> list[str]:
        """The messages of :meth:`matching`."""
        return [r.getMessage() for r in self.matching(contains, level)]
