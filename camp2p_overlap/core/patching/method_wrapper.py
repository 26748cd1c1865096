"""The object the installer sets in a class's ``__dict__`` in place of a
plain method: :func:`method_wrapper`, a factory for ``wrapt.wrap_object``.

For a plain function it builds a plain function, ``patched(self, /, *args,
**kwargs)``, that calls our wrapper as wrapt would, ``wrapper(bound
original, self, args, kwargs)``, and calls the original directly while the
wrapper's switch is off (it has nothing to do: ``switch.on`` false, one
attribute read, :mod:`core.intercept_switch`). Every other
descriptor (a staticmethod, a classmethod, another library's wrapt wrapper
beneath ours), and a module's function, gets a ``wrapt.FunctionWrapper``
as before.

Why not a ``wrapt.FunctionWrapper`` for plain methods too: every lookup of
one through an instance builds a bound proxy, and on the benchmark's
smallest steps (16 wrapped calls per step, each between two short sleeps)
this cost about 3 us per call, against about 0.35 us for a plain function
there (docs/design.md); a plain function is bound by the interpreter itself. What wrapt's removal
needs stays: ``patched.__wrapped__`` is the original, so
``wrapt.wrapper_chain``/``find_wrapper`` see it as a chain entry,
``wrapt.unwrap_object`` restores the original when ours is outermost and
splices ours out from under another library's wrapt wrapper, and
``inspect.signature`` reads the original's signature through it. A call
through the class (``Cls.meth(obj, ...)``) or ``super()`` passes ``obj``
as ``self``, as for the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import FunctionType, MethodType
from typing import Any, Protocol

import wrapt

Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]


class Switch(Protocol):
    """Whether a wrapper has anything to do now: ``on`` (read per call) and
    its truth value (what a wrapt ``enabled`` is tested with)."""

    on: int

    def __bool__(self) -> bool: ...


def method_wrapper(original: Any, wrapper: Wrapper, switch: Switch | None, *, on_class: bool = True) -> Any:
    """What wraps ``original`` (the raw ``__dict__`` entry of a class, or
    with ``on_class`` false a module's function): a plain function for a
    plain function in a class, else a ``wrapt.FunctionWrapper`` (with the
    switch as its ``enabled``). A module's function has no ``self`` to bind."""
    if not (on_class and isinstance(original, FunctionType)):
        return wrapt.FunctionWrapper(original, wrapper, switch)
    patched = _plain(original, wrapper) if switch is None else _switched(original, wrapper, switch)
    functools.update_wrapper(patched, original)  # name, doc, __wrapped__
    return patched


def _plain(original: FunctionType, wrapper: Wrapper) -> Callable[..., Any]:
    def patched(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        return wrapper(MethodType(original, self), self, args, kwargs)

    return patched


def _switched(original: FunctionType, wrapper: Wrapper, switch: Switch) -> Callable[..., Any]:
    def patched(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        if not switch.on:
            return original(self, *args, **kwargs)
        return wrapper(MethodType(original, self), self, args, kwargs)

    return patched


def bound_function(obj: Any) -> Any:
    """The function behind ``obj`` when it is a bound method, else None."""
    return obj.__func__ if isinstance(obj, MethodType) else None
