"""The re-execution watch: a meta path finder that calls back after each
execution of a watched module's body (its import, a re-import, a reload),
leaves the module's loader as the import system found it, and holds its
callbacks weakly."""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from camp2p_overlap.core.patching.reexec_watch import ReexecWatch

NAME = "camp2p_test_reexec_target"


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / f"{NAME}.py").write_text("class Runner:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(NAME, None)


@pytest.fixture
def watch() -> Iterator[ReexecWatch]:
    w = ReexecWatch()
    try:
        yield w
    finally:
        if w in sys.meta_path:
            sys.meta_path.remove(w)  # type: ignore[arg-type]


class Seen:
    def __init__(self) -> None:
        self.classes: list[type] = []

    def __call__(self, module: ModuleType) -> None:
        self.classes.append(module.Runner)

    def method(self, module: ModuleType) -> None:
        self(module)


def test_import_reimport_and_reload_each_call_back_once_with_the_new_class(target: Path, watch: ReexecWatch) -> None:
    seen = Seen()
    watch.watch([NAME], seen)
    first = importlib.import_module(NAME)
    assert seen.classes == [first.Runner]
    importlib.reload(first)
    assert len(seen.classes) == 2 and seen.classes[1] is first.Runner
    del sys.modules[NAME]
    again = importlib.import_module(NAME)
    assert len(seen.classes) == 3 and seen.classes[2] is again.Runner
    # the module keeps the loader the other finders gave, not the watch's
    assert type(again.__loader__).__name__ == "SourceFileLoader"
    assert type(again.__spec__.loader).__name__ == "SourceFileLoader"


def test_an_unwatched_name_and_an_unwatched_callback_are_left_alone(target: Path, watch: ReexecWatch) -> None:
    seen = Seen()
    watch.watch(["some_other_module"], seen)
    importlib.import_module(NAME)
    assert seen.classes == []
    watch.watch([NAME], seen)
    watch.unwatch(seen)
    importlib.reload(sys.modules[NAME])
    assert seen.classes == [] and watch.watched() == []


def test_a_bound_method_is_held_weakly(target: Path, watch: ReexecWatch) -> None:
    owner = Seen()
    watch.watch([NAME], owner.method)
    importlib.import_module(NAME)
    assert len(owner.classes) == 1
    del owner
    gc.collect()
    importlib.reload(sys.modules[NAME])  # the callback's owner is gone: nothing to call


def test_watching_twice_calls_back_once(target: Path, watch: ReexecWatch) -> None:
    seen = Seen()
    watch.watch([NAME], seen)
    watch.watch([NAME], seen)
    importlib.import_module(NAME)
    assert len(seen.classes) == 1
    assert sys.meta_path.count(watch) == 1  # type: ignore[arg-type]
