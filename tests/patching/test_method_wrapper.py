"""What the installer sets on a class (``core.patching.method_wrapper``): a
plain function for a plain method, reached through every access path, and
removable by wrapt; a wrapt wrapper for any other descriptor."""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import wrapt

from camp2p_overlap.core.patching.installer import Installer, method_wrapper


class Target:
    def plain(self, x: int, *, scale: int = 1) -> tuple[str, int, int]:
        """The original's doc."""
        return ("plain", x, scale)

    @staticmethod
    def static(x: int) -> int:
        return x


class Sub(Target):
    def plain(self, x: int, *, scale: int = 1) -> tuple[str, int, int]:
        return super().plain(x + 100, scale=scale)


def _spy(calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls.append((instance, args, kwargs))
        return ("wrapped", *wrapped(*args, **kwargs))

    return wrapper


@pytest.fixture
def installed() -> Any:
    raw = vars(Target)["plain"]
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    handle = wrapt.wrap_object(Target, "plain", method_wrapper, (_spy(calls),))
    yield raw, handle, calls
    if vars(Target)["plain"] is not raw:
        wrapt.unwrap_object(Target, "plain", handle)


def test_a_plain_method_gets_a_plain_function_that_keeps_the_originals_metadata(installed: Any) -> None:
    raw, handle, _ = installed
    assert type(handle) is types.FunctionType and vars(Target)["plain"] is handle
    assert handle.__wrapped__ is raw
    assert handle.__name__ == "plain" and handle.__qualname__ == raw.__qualname__ and handle.__doc__ == raw.__doc__
    assert inspect.signature(handle) == inspect.signature(raw)
    assert list(wrapt.wrapper_chain(handle)) == [handle, raw]


def test_every_access_path_reaches_the_wrapper_with_the_instance(installed: Any) -> None:
    _, _, calls = installed
    obj, sub = Target(), Sub()
    assert obj.plain(1, scale=2) == ("wrapped", "plain", 1, 2)
    assert Target.plain(obj, 3) == ("wrapped", "plain", 3, 1)  # through the class
    assert sub.plain(4) == ("wrapped", "plain", 104, 1)  # through super()
    bound = obj.plain  # a bound method captured after wrapping
    assert bound(5) == ("wrapped", "plain", 5, 1)
    assert [(i, a, k) for i, a, k in calls] == [
        (obj, (1,), {"scale": 2}),
        (obj, (3,), {}),
        (sub, (104,), {"scale": 1}),
        (obj, (5,), {}),
    ]


def test_wrapt_removes_it_exactly_and_splices_it_out_from_under_a_foreign_wrapt_wrapper(installed: Any) -> None:
    raw, handle, _ = installed
    theirs = wrapt.wrap_function_wrapper(Target, "plain", lambda w, i, a, k: ("theirs", *w(*a, **k)))
    assert theirs.__wrapped__ is handle
    assert Target().plain(1) == ("theirs", "wrapped", "plain", 1, 1)
    wrapt.unwrap_object(Target, "plain", handle)  # ours, buried: spliced out
    assert vars(Target)["plain"] is theirs and theirs.__wrapped__ is raw
    assert Target().plain(2) == ("theirs", "plain", 2, 1)
    wrapt.unwrap_object(Target, "plain", theirs)
    assert vars(Target)["plain"] is raw


def test_any_other_descriptor_gets_a_wrapt_wrapper() -> None:
    raw = vars(Target)["static"]
    handle = wrapt.wrap_object(Target, "static", method_wrapper, (lambda w, i, a, k: w(*a, **k) * 10,))
    try:
        assert isinstance(handle, wrapt.FunctionWrapper) and handle.__wrapped__ is raw
        assert Target.static(2) == 20 and Target().static(3) == 30
    finally:
        wrapt.unwrap_object(Target, "static", handle)
    assert vars(Target)["static"] is raw


def test_a_modules_function_gets_a_wrapt_wrapper_with_no_instance() -> None:
    def free(x: int = 1, *, scale: int = 2) -> tuple[int, int]:
        return (x, scale)

    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    handle = method_wrapper(free, _spy(calls), on_class=False)
    assert isinstance(handle, wrapt.FunctionWrapper)
    assert handle(scale=3) == ("wrapped", 1, 3) and handle(4) == ("wrapped", 4, 2)
    assert calls == [(None, (), {"scale": 3}), (None, (4,), {})]


def test_the_installer_knows_a_bound_method_of_its_plain_wrapper(installed: Any) -> None:
    _, handle, _ = installed
    installer = Installer()
    installer.claim(handle)
    assert installer.handle_of(Target().plain) is handle and installer.handle_of(handle) is handle
    assert installer.handle_of(Target.static) is None
