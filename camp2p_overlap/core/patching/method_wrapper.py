"""The object the installer sets in a class's ``__dict__`` in place of a
plain method: :func:`method_wrapper`, a factory for ``wrapt.wrap_object``.

For a plain function it builds a plain function, ``patched(self, /, *args,
**kwargs)``, that calls our wrapper as wrapt would, ``wrapper(bound
original, self, args, kwargs)``. Every other
descriptor (a staticmethod, a classmethod, another library's wrapt wrapper
beneath ours), and a module's function, gets a ``wrapt.FunctionWrapper``
as before.

Why not a ``wrapt.FunctionWrapper`` for plain methods too: every lookup of
one through an instance builds a bound proxy, which costs several times
what a plain function costs (docs/benchmark.md, "Earlier runs"); a plain
function is bound by the interpreter itself. What wrapt's removal
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
from typing import Any

import wrapt

Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]


def method_wrapper(original: Any, wrapper: Wrapper, *, on_class: bool = True) -> Any:
    """What wraps ``original`` (the raw ``__dict__`` entry of a class, or
    with ``on_class`` false a module's function): a plain function for a
    plain function in a class, else a ``wrapt.FunctionWrapper``. A module's
    function has no ``self`` to bind."""
    if not (on_class and isinstance(original, FunctionType)):
        return wrapt.FunctionWrapper(original, wrapper)
    patched = _plain(original, wrapper)
    functools.update_wrapper(patched, original)  # name, doc, __wrapped__
    return patched


def _plain(original: FunctionType, wrapper: Wrapper) -> Callable[..., Any]:
    def patched(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        return wrapper(MethodType(original, self), self, args, kwargs)

    return patched


def bound_function(obj: Any) -> Any:
    """The function behind ``obj`` when it is a bound method, else None."""
    return obj.__func__ if isinstance(obj, MethodType) else None
