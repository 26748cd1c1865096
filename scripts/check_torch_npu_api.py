#!/usr/bin/env python3
"""Check torch_npu's API against what camp2p_overlap calls, from the real wheels.

Downloads (once; they are cached) the torch-npu wheels the supported stacks
pair with, opens each as a zip and reads its Python files with ``ast``,
without importing anything (importing torch_npu needs CANN). Every
``torch.npu`` / ``torch_npu`` name the patch layer and its tools call is
looked up the way Python would find it (``torch.npu`` is ``torch_npu.npu``:
``torch_npu/__init__.py`` registers it as torch's ``npu`` device module),
through re-exports and ``from .x import *`` with ``__all__``, class bodies
and their Python base classes, and its signature is checked against the
call we make (how many positional arguments, which keywords). Names that
live in the C extension (``torch_npu._C``: device property fields, the
profiler's activity enum) are looked for as the strings pybind11 registers
them under in the wheel's shared libraries, next to their class's name.

    python scripts/check_torch_npu_api.py                  # both builds
    python scripts/check_torch_npu_api.py --json out/torch_npu_api.json
    python scripts/check_torch_npu_api.py --version 2.10.0.post2 --cache /tmp/wheels
    python scripts/check_torch_npu_api.py --wheel path/to/torch_npu-...whl

The table of expected names is :data:`EXPECTED` (name, our call sites, the
call's shape); an ``optional`` row is reported but never fails the run (an
API we may use, or one upstream's code calls through ``torch.npu``).

Exit status: 0 when every required name is found with a compatible
signature in every build; 1 when one is missing or incompatible; 2 when a
wheel could not be had (``pip download`` failed, the registry could not be
reached). Only the standard library and ``packaging`` are needed; when
``camp2p_overlap`` is importable its capture-fix verdict for the build
(``core/patching/torch_npu_capture.py``) is reported as well.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CACHE = Path("~/.cache/camp2p-overlap/torch-npu-wheels")
#: Ascend hosts are aarch64; PyPI has torch-npu for manylinux_2_28 aarch64 and x86_64 (cp39-cp311 and up).
DEFAULT_PLATFORM = "manylinux_2_28_aarch64"
DEFAULT_PYTHON = "3.11"
PIP_TIMEOUT_S = 900


@dataclass(frozen=True)
class Build:
    """A torch-npu release one of the supported stacks pairs with."""

    version: str
    stack: str


#: The builds the supported stacks pin (README.md, "Install and switch on").
BUILDS: tuple[Build, ...] = (
    Build("2.9.0", "vllm-0.19.1: vLLM-Ascend v0.19.1rc1 pins torch-npu==2.9.0"),
    Build(
        "2.10.0.post2",
        "vllm-0.26.0: vLLM-Ascend 80d8c194f (afd-plugin main's stack) pins torch-npu==2.10.0.post2",
    ),
)

#: Public prefixes and the wheel's module they name.
ALIASES = {"torch.npu": "torch_npu.npu"}


@dataclass(frozen=True)
class Expect:
    """One name we call, where, and how.

    ``kind``: ``function`` (a module-level callable), ``class`` (called to
    construct one: the Python ``__new__``/``__init__`` are checked),
    ``method`` (called on an instance: ``self`` is not counted),
    ``assign`` (a module-level value), or ``c-string`` (a name in the C
    extension: each of ``strings`` must appear in a shared library of the
    wheel within a few hundred bytes after ``anchor``).
    ``args``/``kwargs``: the positional argument count and the keywords of
    our call; the callee must accept them and require nothing else.
    """

    name: str
    where: str
    kind: str
    args: int = 0
    kwargs: tuple[str, ...] = ()
    optional: bool = False
    strings: tuple[str, ...] = ()
    anchor: str = ""
    note: str = ""

    @property
    def call(self) -> str:
        if self.kind in ("c-string", "assign"):
            return ""
        parts = [f"a{i}" for i in range(self.args)] + [f"{k}=..." for k in self.kwargs]
        return f"({', '.join(parts)})"

    @property
    def label(self) -> str:
        return f"{self.name}{self.call}"


_B = "core/overlap/streams/backend.py"
_S = "core/overlap/session.py"
_G = "core/overlap/graphs.py"
_A = "core/overlap/adaptive.py"
_R = "tools/bench/runner.py"
_P = "tools/bench/profile.py"
_UP = "emulation/standins/afd_plugin/v1/worker/npu/graph_path.py (upstream's runner, modelled)"

#: Every torch.npu / torch_npu name camp2p_overlap (and its tools) calls, with the call's shape. Paths are under
#: camp2p_overlap/.
EXPECTED: tuple[Expect, ...] = (
    # -- streams and events: the device module protocol (core/overlap/streams/base.py DeviceModule) --
    Expect(
        "torch.npu.Stream", f"{_B} StreamBackend.new_stream: Stream(device=...) / Stream()", "class", 0, ("device",)
    ),
    Expect("torch.npu.Stream.wait_event", f"{_S} StepSession.wait_event", "method", 1),
    Expect("torch.npu.Stream.synchronize", f"{_B} StreamBackend.synchronize", "method", 0),
    Expect("torch.npu.Stream.wait_stream", _UP, "method", 1, optional=True),
    Expect(
        "torch.npu.Stream.query", "base.py DeviceModule protocol (not called on a device)", "method", 0, optional=True
    ),
    Expect("torch.npu.Event", f"{_B} StreamBackend.event / end_marker: Event()", "class", 0),
    Expect(
        "torch.npu.Event",
        f"{_B} StreamBackend.timing_pair; emulation/kernel_world.py DeviceDelay._measure",
        "class",
        0,
        ("enable_timing",),
    ),
    Expect("torch.npu.Event.record", f"{_S} StepSession._record; {_B} end_marker; {_A} StepTimings.timed", "method", 1),
    Expect("torch.npu.Event.wait", "reached through Stream.wait_event (torch_npu's own)", "method", 1),
    Expect(
        "torch.npu.Event.query",
        f"watch/watchdog.py _all_complete, ReplayWatch._run; watch/stall_report.py; {_A} read_ready",
        "method",
        0,
    ),
    Expect("torch.npu.Event.synchronize", f"{_A} StepTimings.read_ready", "method", 0),
    Expect("torch.npu.Event.elapsed_time", f"{_A} read_ready; emulation/kernel_world.py DeviceDelay", "method", 1),
    Expect("torch.npu.current_stream", f"{_B} compute_stream, end_marker; {_A} timed", "function", 0),
    Expect("torch.npu.set_stream", f"{_S} StepSession.recv, join", "function", 1),
    Expect("torch.npu.stream", f"{_B} submit; {_S} _submit, send; {_P} mark_streams", "function", 1),
    Expect("torch.npu.synchronize", f"{_R} _cuda_memory.measure; {_P}", "function", 0),
    Expect("torch.npu.is_current_stream_capturing", f"{_B} StreamBackend.__init__ (is_capturing)", "function", 0),
    # -- decode graphs (core/overlap/graphs.py) --
    Expect("torch.npu.NPUGraph", f"{_G} GraphCapture.second", "class", 0),
    Expect(
        "torch.npu.graph", f"{_G} GraphCapture.second: graph(g, pool=..., stream=...)", "class", 1, ("pool", "stream")
    ),
    Expect("torch.npu.graph.__enter__", f"{_G} GraphCapture.second (with ...)", "method", 0),
    Expect("torch.npu.graph.__exit__", f"{_G} GraphCapture.second (with ...)", "method", 3),
    Expect(
        "torch.npu.graph",
        "not passed by us (the default, global, is what docs/design.md assumes)",
        "class",
        1,
        ("capture_error_mode",),
        optional=True,
    ),
    Expect("torch.npu.NPUGraph.replay", f"{_G} VariantGraph.replay, GraphCapture.replay", "method", 0),
    Expect(
        "torch.npu.NPUGraph.capture_begin",
        "torch.npu.graph.__enter__ (torch_npu's own, with our pool)",
        "method",
        0,
        ("pool", "capture_error_mode"),
    ),
    Expect("torch.npu.NPUGraph.capture_end", "torch.npu.graph.__exit__ (torch_npu's own)", "method", 0),
    Expect("torch.npu.NPUGraph.pool", "upstream's graph code may share a pool through it", "method", 0, optional=True),
    Expect("torch.npu.graph_pool_handle", _UP, "function", 0),
    # -- memory and device --
    Expect("torch.npu.mem_get_info", f"{_G} _free_bytes; {_R} _cuda_memory.measure", "function", 0),
    Expect("torch.npu.memory_allocated", f"{_R} _cuda_memory.measure", "function", 0),
    Expect("torch.npu.empty_cache", f"{_R} _cuda_memory.measure", "function", 0),
    Expect("torch.npu.current_device", f"{_P} profile_device_step; emulation/kernel_world.py", "function", 0),
    Expect("torch.npu.is_available", "core/overlap/streams/__init__.py device_module; tools/doctor.py", "function", 0),
    Expect("torch.npu.device_count", "tools/doctor.py _device", "function", 0),
    Expect(
        "torch.npu.get_device_properties", "not called on an NPU yet (AI core counts)", "function", 1, optional=True
    ),
    Expect(
        "torch_npu._C._NPUDeviceProperties.cube_core_num",
        "get_device_properties(d).cube_core_num (not called yet)",
        "c-string",
        optional=True,
        strings=("cube_core_num",),
        anchor="_NPUDeviceProperties",
    ),
    Expect(
        "torch_npu._C._NPUDeviceProperties.vector_core_num",
        "get_device_properties(d).vector_core_num (not called yet)",
        "c-string",
        optional=True,
        strings=("vector_core_num",),
        anchor="_NPUDeviceProperties",
    ),
    Expect(
        "torch_npu._C._NPUDeviceProperties.multi_processor_count",
        "CUDA's field name (tools/bench/sweep.py reads it on CUDA only)",
        "c-string",
        optional=True,
        strings=("multi_processor_count",),
        anchor="_NPUDeviceProperties",
    ),
    # -- per-stream / per-device AI core limits (not called yet; candidates for the comm streams' core budget) --
    Expect(
        "torch.npu.set_stream_limit",
        "not called yet (a comm stream's core budget)",
        "function",
        1,
        ("cube_num", "vector_num"),
        optional=True,
    ),
    Expect("torch.npu.get_stream_limit", "not called yet", "function", 1, optional=True),
    Expect("torch.npu.reset_stream_limit", "not called yet", "function", 1, optional=True),
    Expect("torch.npu.set_device_limit", "not called yet", "function", 1, ("cube_num", "vector_num"), optional=True),
    Expect("torch.npu.get_device_limit", "not called yet", "function", 1, optional=True),
    Expect(
        "torch_npu._C._npu_set_stream_res_limit",
        "the binding behind set_stream_limit",
        "c-string",
        optional=True,
        strings=("_npu_set_stream_res_limit", "_npu_get_stream_res_limit", "_npu_reset_stream_res_limit"),
        anchor="_npu_set_stream_res_limit",
    ),
    Expect(
        "torch.npu.ExternalEvent",
        "not called (an event whose captured record is an external node)",
        "class",
        0,
        optional=True,
    ),
    # -- the profiler (tools/bench/profile.py capture) --
    Expect(
        "torch_npu.profiler.profile",
        f"{_P} capture: profile(activities=..., on_trace_ready=...)",
        "class",
        0,
        ("activities", "on_trace_ready"),
    ),
    Expect("torch_npu.profiler.profile.__enter__", f"{_P} capture (with ...)", "method", 0),
    Expect("torch_npu.profiler.profile.__exit__", f"{_P} capture (with ...)", "method", 3),
    Expect(
        "torch_npu.profiler.tensorboard_trace_handler", f"{_P} capture: tensorboard_trace_handler(dir)", "function", 1
    ),
    Expect("torch_npu.profiler.ProfilerActivity", f"{_P} capture", "assign"),
    Expect(
        "torch_npu._C._profiler.ProfilerActivity.CPU/NPU",
        f"{_P} capture: ProfilerActivity.CPU, ProfilerActivity.NPU",
        "c-string",
        strings=("CPU", "NPU"),
        anchor="ProfilerActivity",
    ),
    Expect("torch_npu.profiler._ExperimentalConfig", "not passed by us", "class", 0, optional=True),
    Expect("torch_npu.profiler.schedule", "not passed by us", "class", 0, ("wait", "active"), optional=True),
    # -- the build's identity (core/patching/torch_npu_capture.py reads git_version from torch_npu/version.py) --
    Expect("torch_npu.version.git_version", "core/patching/torch_npu_capture.py _git_version", "assign"),
    Expect("torch_npu.version.__version__", "core/patching/torch_npu_capture.py (the version it judges)", "assign"),
)

FOUND = "found"
FOUND_C = "found-c"
MISSING = "missing"
DIFFERS = "signature-differs"
KIND_DIFFERS = "kind-differs"
FAILING = (MISSING, DIFFERS, KIND_DIFFERS)


# ---------------------------------------------------------------------------
# the wheels


class WheelUnavailable(RuntimeError):
    """``pip download`` could not fetch the wheel (the message has pip's output)."""


class RegistryUnreachable(WheelUnavailable):
    """The package registry could not be reached (offline, a proxy, DNS)."""


_NETWORK = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|Connection refused|ConnectTimeout|ReadTimeout|"
    r"timed out|ProxyError|Max retries exceeded|SSLError|No route to host",
    re.IGNORECASE,
)


def wheel_glob(version: str, platform: str) -> str:
    return f"torch_npu-{version}-*-{platform}.whl"


def cached_wheel(cache: Path, version: str, platform: str = DEFAULT_PLATFORM) -> Path | None:
    """The wheel of ``version`` for ``platform`` already in ``cache``, or None."""
    found = sorted(Path(cache).expanduser().glob(wheel_glob(version, platform)))
    return found[-1] if found else None


def download_command(version: str, cache: Path, platform: str, python_version: str) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"torch-npu=={version}", "--platform", platform, "--python-version", python_version,
        "-d", str(Path(cache).expanduser()), "--disable-pip-version-check", "--retries", "1", "--timeout", "20",
    ]  # fmt: skip


def ensure_wheel(
    version: str,
    cache: Path = DEFAULT_CACHE,
    platform: str = DEFAULT_PLATFORM,
    python_version: str = DEFAULT_PYTHON,
) -> Path:
    """The cached wheel of ``version``, downloaded first when absent. Raises
    :class:`RegistryUnreachable` or :class:`WheelUnavailable` with pip's output."""
    found = cached_wheel(cache, version, platform)
    if found is not None:
        return found
    Path(cache).expanduser().mkdir(parents=True, exist_ok=True)
    cmd = download_command(version, cache, platform, python_version)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RegistryUnreachable(f"{' '.join(cmd)}: {type(exc).__name__}: {exc}") from exc
    output = (proc.stdout or "") + (proc.stderr or "")
    found = cached_wheel(cache, version, platform)
    if proc.returncode == 0 and found is not None:
        return found
    tail = "\n".join(output.strip().splitlines()[-12:])
    cls = RegistryUnreachable if _NETWORK.search(output) else WheelUnavailable
    raise cls(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Wheel:
    """A wheel's files, read from the zip on demand (Python sources parsed, never imported)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path)
        self.names = set(self._zip.namelist())
        self._trees: dict[str, ast.Module | None] = {}
        self._blobs: list[tuple[str, bytes]] | None = None

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> Wheel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def module_file(self, module: str) -> str | None:
        """The file of dotted ``module`` in the wheel (a package's ``__init__.py`` first)."""
        base = module.replace(".", "/")
        for candidate in (f"{base}/__init__.py", f"{base}.py"):
            if candidate in self.names:
                return candidate
        return None

    def is_extension(self, module: str) -> bool:
        """Whether ``module`` is a compiled extension of the wheel (``torch_npu/_C.cpython-311-...so``)."""
        base = module.replace(".", "/")
        return any(
            n.startswith(f"{base}.") and n.endswith((".so", ".pyd")) and "/" not in n[len(base) :] for n in self.names
        )

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.names

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.module_file(module)
            self._trees[module] = None if path is None else ast.parse(self._zip.read(path), filename=path)
        return self._trees[module]

    def read_text(self, name: str) -> str | None:
        return self._zip.read(name).decode("utf-8", "replace") if name in self.names else None

    def blobs(self) -> list[tuple[str, bytes]]:
        """The shared libraries of the wheel's top package (read once)."""
        if self._blobs is None:
            self._blobs = [
                (n, self._zip.read(n))
                for n in sorted(self.names)
                if n.startswith("torch_npu/") and (n.endswith(".so") or ".so." in n) and "/dynamo/" not in n
            ]
        return self._blobs

    def metadata_version(self) -> str | None:
        meta = next((n for n in self.names if n.endswith(".dist-info/METADATA")), None)
        text = self.read_text(meta) if meta else None
        m = re.search(r"^Version:\s*(\S+)", text or "", re.MULTILINE)
        return m.group(1) if m else None


# ---------------------------------------------------------------------------
# resolving a dotted name through the wheel's sources


@dataclass
class Target:
    """What a name resolved to."""

    kind: str  # function | class | assign | module | external | missing
    module: str = ""
    node: ast.AST | None = None
    external: str = ""  # the dotted name outside the wheel's Python (kind external)
    in_class: bool = False  # a function found in a class body (a method)
    trail: list[str] = field(default_factory=list)  # how it was found

    def where(self, wheel: Wheel) -> str:
        """``file:line`` in the wheel (or the external name)."""
        path = wheel.module_file(self.module) if self.module else None
        if path and self.node is not None and hasattr(self.node, "lineno"):
            return f"{path}:{self.node.lineno}"  # type: ignore[attr-defined]
        return self.external or path or self.module


def _walk_top(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that bind names at this level (into if/try/with, not into def/class)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _walk_top(stmt.body)
            yield from _walk_top(stmt.orelse)
        elif isinstance(stmt, ast.Try) or (sys.version_info >= (3, 11) and isinstance(stmt, ast.TryStar)):
            yield from _walk_top(stmt.body)  # type: ignore[attr-defined]
            for h in stmt.handlers:  # type: ignore[attr-defined]
                yield from _walk_top(h.body)
            yield from _walk_top(stmt.orelse)  # type: ignore[attr-defined]
            yield from _walk_top(stmt.finalbody)  # type: ignore[attr-defined]
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _walk_top(stmt.body)
        else:
            yield stmt


def _names_bound(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        out: list[str] = []
        for t in stmt.targets:
            elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
            out.extend(e.id for e in elts if isinstance(e, ast.Name))
        return out
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    if isinstance(stmt, ast.ImportFrom):
        return [a.asname or a.name for a in stmt.names if a.name != "*"]
    if isinstance(stmt, ast.Import):
        return [a.asname or a.name.split(".")[0] for a in stmt.names]
    return []


def _is_all(target: ast.expr) -> bool:
    return isinstance(target, ast.Name) and target.id == "__all__"


class Resolver:
    """Finds dotted names in a :class:`Wheel` the way an import would, without running anything."""

    def __init__(self, wheel: Wheel) -> None:
        self.wheel = wheel

    # -- modules --
    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = module if self.wheel.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{node.module}" if node.module else base

    def public_names(self, module: str) -> list[str] | None:
        """``__all__`` of ``module`` when it is a literal list/tuple (with ``+=`` of literals), else None."""
        tree = self.wheel.tree(module)
        if tree is None:
            return None
        names: list[str] | None = None
        for stmt in _walk_top(tree.body):
            value = None
            if isinstance(stmt, ast.Assign) and any(_is_all(t) for t in stmt.targets):
                value, names = stmt.value, []
            elif isinstance(stmt, ast.AugAssign) and _is_all(stmt.target):
                value = stmt.value
            if value is not None:
                try:
                    names = [*(names or []), *ast.literal_eval(value)]
                except ValueError:
                    return None
        return names

    def _star_provides(self, module: str, name: str, seen: set[tuple[str, str]]) -> Target | None:
        if self.wheel.tree(module) is None:
            return None
        public = self.public_names(module)
        if public is not None and name not in public:
            return None
        if public is None and name.startswith("_"):
            return None
        t = self.lookup(module, name, seen)
        return None if t.kind == "missing" else t

    def lookup(self, module: str, name: str, seen: set[tuple[str, str]] | None = None) -> Target:
        """``module.name``: the last top-level binding of ``name`` in ``module`` (followed through imports)."""
        seen = set() if seen is None else seen
        if (module, name) in seen:
            return Target("missing", module, trail=[f"import cycle at {module}.{name}"])
        seen.add((module, name))
        tree = self.wheel.tree(module)
        if tree is None:
            sub = f"{module}.{name}"
            if self.wheel.module_file(sub):
                return Target("module", sub)
            return Target("external", external=sub)
        found: Target | None = None
        for stmt in _walk_top(tree.body):
            if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
                star = self._star_provides(self._absolute(module, stmt), name, seen)
                if star is not None:
                    found = star
                continue
            if name not in _names_bound(stmt):
                continue
            found = self._binding(module, name, stmt, seen)
        if found is None:
            # A submodule is an attribute of its package once imported (a C extension one too).
            sub = f"{module}.{name}"
            if self.wheel.module_file(sub):
                return Target("module", sub)
            if self.wheel.is_extension(sub):
                return Target("external", module, external=sub)
            return Target("missing", module)
        return found

    def _binding(self, module: str, name: str, stmt: ast.stmt, seen: set[tuple[str, str]]) -> Target:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Target("function", module, stmt)
        if isinstance(stmt, ast.ClassDef):
            return Target("class", module, stmt)
        if isinstance(stmt, ast.ImportFrom):
            alias = next(a for a in stmt.names if (a.asname or a.name) == name)
            base = self._absolute(module, stmt)
            if self.wheel.module_file(f"{base}.{alias.name}"):
                return Target("module", f"{base}.{alias.name}")
            if self.wheel.tree(base) is None:
                return Target("external", module, stmt, external=f"{base}.{alias.name}")
            t = self.lookup(base, alias.name, seen)
            t.trail.insert(0, f"{module} imports it from {base}")
            return t
        if isinstance(stmt, ast.Import):
            alias = next(a for a in stmt.names if (a.asname or a.name.split(".")[0]) == name)
            target = alias.name if alias.asname else alias.name.split(".")[0]
            if self.wheel.module_file(target):
                return Target("module", target)
            return Target("external", module, stmt, external=target)
        value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Name, ast.Attribute)):
            t = self.resolve_expr(module, value, seen)
            if t.kind in ("function", "class"):
                return t
        return Target("assign", module, stmt)

    def resolve_expr(self, module: str, expr: ast.expr, seen: set[tuple[str, str]] | None = None) -> Target:
        """A ``Name`` or ``Attribute`` chain as written in ``module``."""
        if isinstance(expr, ast.Name):
            if expr.id == "object":
                return Target("external", external="builtins.object")
            return self.lookup(module, expr.id, set() if seen is None else seen)
        if isinstance(expr, ast.Attribute):
            base = self.resolve_expr(module, expr.value, seen)
            return self.member(base, expr.attr)
        return Target("assign", module, expr)

    # -- members --
    def member(self, owner: Target, attr: str) -> Target:
        if owner.kind == "module":
            return self.lookup(owner.module, attr)
        if owner.kind == "external":
            return Target("external", external=f"{owner.external}.{attr}")
        if owner.kind == "class":
            return self._class_member(owner, attr, set())
        return Target("missing", owner.module, trail=[f"{attr} looked up on a {owner.kind}"])

    def _class_member(self, cls: Target, attr: str, seen: set[int]) -> Target:
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        if id(node) in seen:
            return Target("missing", cls.module)
        seen.add(id(node))
        found: Target | None = None
        for stmt in _walk_top(node.body):
            if attr not in _names_bound(stmt):
                continue
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found = Target("function", cls.module, stmt, in_class=True)
            elif isinstance(stmt, ast.ClassDef):
                found = Target("class", cls.module, stmt)
            else:
                found = Target("assign", cls.module, stmt)
        if found is not None:
            return found
        externals: list[str] = []
        for base in node.bases:
            b = self.resolve_expr(cls.module, base)
            if b.kind == "class":
                t = self._class_member(b, attr, seen)
                if t.kind != "missing":
                    t.trail.insert(0, f"inherited from {b.node.name}")  # type: ignore[union-attr]
                    return t
            elif b.kind == "external" and b.external != "builtins.object":
                externals.append(b.external)
        if externals:
            return Target("external", cls.module, external=f"{externals[0]}.{attr}", trail=["a C-extension base"])
        return Target("missing", cls.module)

    def resolve(self, dotted: str) -> Target:
        """A public dotted name (``torch.npu.Event.record``)."""
        for prefix, real in ALIASES.items():
            if dotted == prefix or dotted.startswith(prefix + "."):
                dotted = real + dotted[len(prefix) :]
        parts = dotted.split(".")
        # The longest prefix that is a module of the wheel.
        for i in range(len(parts), 0, -1):
            if self.wheel.module_file(".".join(parts[:i])):
                t, rest = Target("module", ".".join(parts[:i])), parts[i:]
                break
        else:
            return Target("missing", trail=[f"no module of {dotted} in the wheel"])
        for attr in rest:
            t = self.member(t, attr)
            if t.kind in ("missing", "assign"):
                if attr != rest[-1]:
                    return Target("missing", t.module, trail=[*t.trail, f"{attr} is not a class or module"])
                break
        return t


# ---------------------------------------------------------------------------
# signatures


@dataclass(frozen=True)
class Params:
    positional: tuple[str, ...]  # positional-or-keyword and positional-only, in order
    positional_only: frozenset[str]
    keyword_only: tuple[str, ...]
    required: frozenset[str]
    varargs: bool
    varkw: bool
    text: str


def params_of(fn: ast.FunctionDef | ast.AsyncFunctionDef, *, bound: bool) -> Params:
    """The parameters of ``fn``; ``bound``: drop the first (``self``/``cls``) unless a staticmethod."""
    a = fn.args
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    pos = [*a.posonlyargs, *a.args]
    n_default = len(a.defaults)
    required = {p.arg for p in pos[: len(pos) - n_default]}
    required |= {k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None}
    names = [p.arg for p in pos]
    if bound and not static and names:
        required.discard(names[0])
        names = names[1:]
    return Params(
        positional=tuple(names),
        positional_only=frozenset(p.arg for p in a.posonlyargs),
        keyword_only=tuple(k.arg for k in a.kwonlyargs),
        required=frozenset(required),
        varargs=a.vararg is not None,
        varkw=a.kwarg is not None,
        text=f"{fn.name}({ast.unparse(a)})",
    )


def call_problems(p: Params, args: int, kwargs: Sequence[str]) -> list[str]:
    """Why a call with ``args`` positional arguments and ``kwargs`` would not bind to ``p`` (empty: it binds)."""
    problems: list[str] = []
    if args > len(p.positional) and not p.varargs:
        problems.append(f"takes at most {len(p.positional)} positional argument(s), we pass {args}")
    supplied = set(p.positional[:args])
    for kw in kwargs:
        if kw in p.positional_only:
            problems.append(f"{kw} is positional-only")
        elif kw in p.positional or kw in p.keyword_only:
            if kw in supplied:
                problems.append(f"{kw} given twice")
            supplied.add(kw)
        elif not p.varkw:
            problems.append(f"has no parameter {kw}")
    missing = sorted(p.required - supplied)
    if missing:
        problems.append(f"requires {', '.join(missing)}, which we do not pass")
    return problems


# ---------------------------------------------------------------------------
# checking one wheel


@dataclass
class Result:
    name: str
    label: str
    where: str
    kind: str
    optional: bool
    status: str
    defined_at: str = ""
    signature: str = ""
    detail: str = ""


@dataclass
class BuildReport:
    wheel: str
    sha256: str
    version: str | None
    git_version: str | None
    results: list[Result]
    capture_fix: str | None = None
    stack: str = ""

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status in FAILING and not r.optional]

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def find_strings(wheel: Wheel, strings: Sequence[str], anchor: str, window: int = 512) -> tuple[bool, str]:
    """Whether every one of ``strings`` is a NUL-delimited string of a shared library within ``window`` bytes after
    a NUL-delimited ``anchor`` (how pybind11 lays out the names it registers), and where."""
    a = b"\0" + anchor.encode() + b"\0"
    needles = [b"\0" + s.encode() + b"\0" for s in strings]
    for name, blob in wheel.blobs():
        start = blob.find(a)
        while start >= 0:
            near = blob[start : start + len(a) + window]
            if all(n in near or (n == a) for n in needles):
                return True, f"{name} @ {start:#x}"
            start = blob.find(a, start + 1)
    return False, f"not within {window} bytes after {anchor!r} in {len(wheel.blobs())} shared libraries"


def _constructors(res: Resolver, cls: Target) -> list[Target]:
    found = []
    for attr in ("__new__", "__init__"):
        t = res.member(cls, attr)
        if t.kind == "function":
            found.append(t)
    return found


def check_one(res: Resolver, e: Expect) -> Result:
    r = Result(e.name, e.label, e.where, e.kind, e.optional, MISSING)
    if e.kind == "c-string":
        ok, where = find_strings(res.wheel, e.strings, e.anchor)
        r.status, r.defined_at = (FOUND_C, where) if ok else (MISSING, "")
        r.detail = f"strings {', '.join(e.strings)} after {e.anchor}" + ("" if ok else f": {where}")
        return r
    t = res.resolve(e.name)
    r.defined_at = t.where(res.wheel)
    if t.kind == "missing":
        r.detail = "; ".join(t.trail) or f"not bound in {t.module or 'the wheel'}"
        return r
    if t.kind == "external":
        mod_name = t.external.rpartition(".")[2]
        if t.external.startswith("torch_npu._C"):
            ok = any(b"\0" + mod_name.encode() + b"\0" in blob for _, blob in res.wheel.blobs())
            r.status = FOUND_C if ok else MISSING
            r.detail = f"from the C extension ({t.external})" + ("" if ok else ": name not in any shared library")
        else:
            r.status, r.detail = FOUND_C, f"outside the wheel's Python ({t.external}): not checked"
        return r
    if e.kind == "assign":
        r.status = FOUND
        r.detail = t.kind
        if isinstance(t.node, (ast.Assign, ast.AnnAssign)) and t.node.value is not None:
            r.signature = ast.unparse(t.node.value)[:80]
        return r
    want_kind = {"class": ("class",), "function": ("function", "class"), "method": ("function",)}[e.kind]
    if t.kind not in want_kind:
        r.status, r.detail = KIND_DIFFERS, f"expected a {e.kind}, found a {t.kind}"
        return r
    if e.kind == "class":
        ctors = _constructors(res, t)
        if not ctors:
            r.status, r.detail = FOUND, "constructor not in Python (a C-extension base): call not checked"
            return r
        problems: list[str] = []
        sigs = []
        for c in ctors:
            p = params_of(c.node, bound=True)  # type: ignore[arg-type]
            sigs.append(p.text)
            problems += [f"{p.text}: {x}" for x in call_problems(p, e.args, e.kwargs)]
        r.signature = "; ".join(sigs)
    else:
        bound = e.kind == "method" or (t.kind == "class")
        node = t.node
        if t.kind == "class":  # a class called as a function (a context manager class)
            ctors = _constructors(res, t)
            if not ctors:
                r.status, r.detail = FOUND, "class; constructor in C: call not checked"
                return r
            node = ctors[-1].node
        p = params_of(node, bound=bound)  # type: ignore[arg-type]
        r.signature = p.text
        problems = call_problems(p, e.args, e.kwargs)
    r.status = DIFFERS if problems else FOUND
    r.detail = "; ".join(problems) if problems else " <- ".join(t.trail)
    return r


def capture_fix_verdict(version: str | None, git_version: str | None) -> str | None:
    """camp2p_overlap's own verdict on the build (None when the package cannot be imported)."""
    if version is None:
        return None
    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from camp2p_overlap.core.patching.torch_npu_capture import judge_capture_fix
    except Exception:  # noqa: BLE001 - a report line, not a check
        return None
    v = judge_capture_fix(version, git_version)
    return f"{'fixed' if v.fixed else 'NOT fixed'}: {v.reason}"


_GIT_VERSION = re.compile(r"""^git_version\s*=\s*(['"])(.*?)\1""", re.MULTILINE)


def check_wheel(path: Path | str, expected: Sequence[Expect] | None = None, *, stack: str = "") -> BuildReport:
    """Check every row of ``expected`` (default :data:`EXPECTED`) against the wheel at ``path``."""
    path = Path(path)
    expected = EXPECTED if expected is None else expected
    with Wheel(path) as w:
        res = Resolver(w)
        results = [check_one(res, e) for e in expected]
        m = _GIT_VERSION.search(w.read_text("torch_npu/version.py") or "")
        git_version = m.group(2) if m else None
        version = w.metadata_version()
    return BuildReport(
        wheel=path.name,
        sha256=sha256_of(path),
        version=version,
        git_version=git_version,
        results=results,
        capture_fix=capture_fix_verdict(version, git_version),
        stack=stack,
    )


# ---------------------------------------------------------------------------
# the report


def differences(reports: Sequence[BuildReport]) -> list[str]:
    """Rows whose status or signature is not the same in every build."""
    out = []
    for i, row in enumerate(reports[0].results if reports else []):
        if row.kind == "assign":  # values (the version, the commit) differ by design
            continue
        seen = {(r.results[i].status, r.results[i].signature) for r in reports}
        if len(seen) > 1:
            per = "; ".join(f"{r.version}: {r.results[i].status} {r.results[i].signature}" for r in reports)
            out.append(f"{row.label}: {per}")
    return out


def format_report(report: BuildReport) -> str:
    lines = [
        f"== torch_npu {report.version} ({report.wheel})",
        f"   sha256 {report.sha256}",
        f"   git_version {report.git_version}" + (f"; {report.stack}" if report.stack else ""),
    ]
    if report.capture_fix:
        lines.append(f"   capture fix: {report.capture_fix}")
    width = max(len(r.label) for r in report.results)
    for r in report.results:
        flag = " (optional)" if r.optional else ""
        sig = f"  {r.signature}" if r.signature else ""
        at = f"  [{r.defined_at}]" if r.defined_at else ""
        detail = f"  -- {r.detail}" if r.detail and r.status != FOUND else ""
        lines.append(f"   {r.status:<17} {r.label:<{width}}{sig}{at}{detail}{flag}")
    n_fail = len(report.failures)
    lines.append(f"   {'OK' if report.ok else f'FAILED: {n_fail} required name(s) missing or incompatible'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"wheel cache (default {DEFAULT_CACHE})")
    ap.add_argument("--platform", default=DEFAULT_PLATFORM, help=f"pip --platform (default {DEFAULT_PLATFORM})")
    ap.add_argument("--python-version", default=DEFAULT_PYTHON, help=f"pip --python-version (default {DEFAULT_PYTHON})")
    ap.add_argument(
        "--version", action="append", dest="versions", help="a torch-npu version (repeatable; default: BUILDS)"
    )
    ap.add_argument("--wheel", action="append", type=Path, default=[], help="check this wheel file (repeatable)")
    ap.add_argument("--json", type=Path, help="write the report as JSON here")
    ns = ap.parse_args(argv)

    jobs: list[tuple[Path, str]] = [(w, "") for w in ns.wheel]
    if not ns.wheel or ns.versions:
        stacks = {b.version: b.stack for b in BUILDS}
        for v in ns.versions or [b.version for b in BUILDS]:
            try:
                jobs.append((ensure_wheel(v, ns.cache, ns.platform, ns.python_version), stacks.get(v, "")))
            except WheelUnavailable as exc:
                print(f"torch-npu {v}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 2
    reports = [check_wheel(path, stack=stack) for path, stack in jobs]
    for rep in reports:
        print(format_report(rep))
    diffs = differences(reports)
    if len(reports) > 1:
        print("== between builds: " + ("no differences" if not diffs else f"{len(diffs)} row(s) differ"))
        for d in diffs:
            print(f"   {d}")
    ok = all(r.ok for r in reports)
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "ok": ok,
            "platform": ns.platform,
            "python_version": ns.python_version,
            "builds": [r.as_dict() for r in reports],
            "differences": diffs,
        }
        ns.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
