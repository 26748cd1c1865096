"""Stand-ins for the afd-plugin modules this project patches, importable at
the real dotted paths (``afd_plugin.…``) through :func:`install`.

afd-plugin, vLLM-Ascend and torch_npu cannot be installed off an Ascend box,
so tests and the benchmark import these instead. They keep exactly the
shapes described in the project's ``docs/design.md`` ("The upstream
interface we wrap"). Each import
executes the stand-in file under the requested name, so every install gives
fresh module and class objects, and wrapt's post-import hooks fire as for a
real import. The finder sits at the end of ``sys.meta_path`` and never
shadows a real, installed afd-plugin: :func:`install` refuses the real root
name when one is importable, unless ``force=True``.

The stand-ins model one upstream stack at a time (:data:`STACKS`): the files
under ``afd_plugin/`` follow afd-plugin's ``release/v0.19.1rc1`` line; a
stack whose upstream file differs maps that module to its own stand-in file
in the same folder (``ffn_model_runner_main.py`` for afd-plugin ``main``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REAL_ROOT = "afd_plugin"
#: Where the benchmark puts the stand-ins when a real afd-plugin is installed.
ALIAS_ROOT = "camp2p_overlap_standin_afd_plugin"

RUNNER_MODULE = "v1.worker.npu.ffn_model_runner"
CONNECTOR_MODULE = "connectors.npu.camp2p"
METADATA_MODULE = "connectors.metadata"

_BASE = Path(__file__).resolve().parent / "afd_plugin"

#: The stack the stand-ins model when none is named: the manifests'
#: ``DEFAULT_STACK``, kept here under its own name because the stand-ins
#: import nothing of ours (their import contract); a test checks the two agree.
STANDINS_DEFAULT_STACK = "vllm-0.19.1"
#: Per stack (the name of its ``patches/`` manifest): the modules, relative
#: to the root, whose stand-in is another file of the same folder (its stem).
STACKS: dict[str, dict[str, str]] = {
    "vllm-0.19.1": {},  # afd-plugin release/v0.19.1rc1
    "vllm-0.26.0": {RUNNER_MODULE: "ffn_model_runner_main"},  # afd-plugin main (2e4378f)
}


class StandinFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str, stack: str = STANDINS_DEFAULT_STACK) -> None:
        if stack not in STACKS:
            raise ValueError(f"no stand-ins for stack {stack!r}; there are {', '.join(STACKS)}")
        self.root = root
        self.stack = stack

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.root and not fullname.startswith(self.root + "."):
            return None
        rel = fullname[len(self.root) :].lstrip(".")
        stem = STACKS[self.stack].get(rel)
        if stem is not None:
            rel = rel.rsplit(".", 1)[0] + "." + stem
        where = _BASE.joinpath(*rel.split(".")) if rel else _BASE
        if where.is_dir() and (where / "__init__.py").is_file():
            spec = importlib.util.spec_from_file_location(fullname, where / "__init__.py")
            if spec is not None:
                # An empty __path__: every submodule comes through this finder
                # (the path finder would find the release line's files directly).
                spec.submodule_search_locations = []
            return spec
        file = where.with_suffix(".py")
        if file.is_file():
            return importlib.util.spec_from_file_location(fullname, file)
        return None


_installed: dict[str, StandinFinder] = {}


def real_afd_plugin_installed() -> bool:
    if REAL_ROOT in _installed:
        return False
    try:
        return importlib.util.find_spec(REAL_ROOT) is not None
    except (ImportError, ValueError):
        return False


def install(root: str = REAL_ROOT, *, force: bool = False, stack: str | None = None) -> str:
    """Make ``{root}.…`` importable from the stand-ins of ``stack`` (default:
    the stack already installed at ``root``, else :data:`STANDINS_DEFAULT_STACK`).
    Idempotent; asking for another stack at an installed root is an error
    (its modules are already imported: :func:`uninstall` first)."""
    if root in _installed:
        have = _installed[root].stack
        if stack is not None and stack != have:
            raise RuntimeError(f"the stand-ins of stack {have!r} are installed at {root!r}; uninstall them first")
        return root
    if root == REAL_ROOT and not force and real_afd_plugin_installed():
        raise RuntimeError(
            "a real afd_plugin is installed; install the stand-ins under another root "
            f"(e.g. {ALIAS_ROOT!r}) so they never shadow it"
        )
    finder = StandinFinder(root, stack or STANDINS_DEFAULT_STACK)
    sys.meta_path.append(finder)
    _installed[root] = finder
    return root


def installed_stack(root: str = REAL_ROOT) -> str | None:
    """The stack whose stand-ins are installed at ``root``, or None."""
    finder = _installed.get(root)
    return finder.stack if finder is not None else None


def uninstall(root: str = REAL_ROOT) -> None:
    """Remove the finder and forget every ``{root}.…`` module."""
    finder = _installed.pop(root, None)
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
        del sys.modules[name]


def import_standins(root: str = REAL_ROOT) -> tuple[ModuleType, ModuleType, ModuleType]:
    """Import (runner module, connector module, metadata module)."""
    runner = importlib.import_module(f"{root}.{RUNNER_MODULE}")
    connector = importlib.import_module(f"{root}.{CONNECTOR_MODULE}")
    metadata = importlib.import_module(f"{root}.{METADATA_MODULE}")
    return runner, connector, metadata
