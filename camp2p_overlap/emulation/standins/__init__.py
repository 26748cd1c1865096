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


class StandinFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.root and not fullname.startswith(self.root + "."):
            return None
        rel = fullname[len(self.root) :].lstrip(".")
        where = _BASE.joinpath(*rel.split(".")) if rel else _BASE
        if where.is_dir() and (where / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(
                fullname, where / "__init__.py", submodule_search_locations=[str(where)]
            )
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


def install(root: str = REAL_ROOT, *, force: bool = False) -> str:
    """Make ``{root}.…`` importable from the stand-ins. Idempotent."""
    if root in _installed:
        return root
    if root == REAL_ROOT and not force and real_afd_plugin_installed():
        raise RuntimeError(
            "a real afd_plugin is installed; install the stand-ins under another root "
            f"(e.g. {ALIAS_ROOT!r}) so they never shadow it"
        )
    finder = StandinFinder(root)
    sys.meta_path.append(finder)
    _installed[root] = finder
    return root


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
