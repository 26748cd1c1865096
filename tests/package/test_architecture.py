"""The package's architecture as tests: no import cycle anywhere in the
package (grimp's import graph, the one import-linter checks the rooms
contract of ``pyproject.toml`` on), and importing the package imports
nothing of the tools or the emulation."""

from __future__ import annotations

from pathlib import Path

import grimp
from support.child import run_program


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("camp2p_overlap", include_external_packages=False)


def test_no_module_is_part_of_an_import_cycle() -> None:
    graph = _graph()
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.append(" -> ".join((importer, *back)))
    assert cycles == []


def test_core_imports_neither_tools_nor_emulation() -> None:
    graph = _graph()
    core = {m for m in graph.modules if m.startswith("camp2p_overlap.core")}
    outside = {m for m in graph.modules if m.startswith(("camp2p_overlap.tools", "camp2p_overlap.emulation"))}
    leaks = [(a, b) for a in sorted(core) for b in sorted(graph.find_modules_directly_imported_by(a)) if b in outside]
    assert leaks == []
    assert len(core) >= 15 and len(outside) >= 10  # the graph really holds the package


def test_the_cycle_check_sees_a_cycle() -> None:
    """The check above can fail: a graph with a cycle is reported."""
    graph = _graph()
    graph.add_import(importer="camp2p_overlap.core.config", imported="camp2p_overlap.core.patching.lifecycle")
    assert graph.find_shortest_chain(
        importer="camp2p_overlap.core.patching.lifecycle", imported="camp2p_overlap.core.config"
    )
    assert graph.find_shortest_chain(
        importer="camp2p_overlap.core.config", imported="camp2p_overlap.core.patching.lifecycle"
    )


def test_importing_the_package_loads_no_tool_or_emulation_module() -> None:
    proc = run_program("modules_loaded_by_import.py", "camp2p_overlap.tools", "camp2p_overlap.emulation")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_one_fork_hook_resets_what_a_child_must_not_inherit() -> None:
    """``os.register_at_fork`` is called in one place (``core/fork.py``);
    every other owner registers its reset there."""
    import camp2p_overlap
    from camp2p_overlap.core import fork

    root = Path(camp2p_overlap.__file__).parent
    sites = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "register_at_fork(" in p.read_text())
    assert sites == ["core/fork.py"]
    assert fork.registered() >= 8  # the engine, gate, counters, guard, runner states, watchdogs, metrics, device
