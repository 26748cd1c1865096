"""``scripts/check_torch_npu_api.py``: torch_npu's API read from its real wheels.

The fast tests build a tiny synthetic wheel in ``tmp_path`` (a zip with a
fake ``torch_npu/npu/streams.py``, ``utils.py``, ``graphs.py``, a fake
shared library holding pybind11-style names) and run the script's AST
checker on it: every kind of row is found where it should be, and the
checker fails where it must (a name that is gone, a signature that lost a
parameter or requires one more, a star import whose ``__all__`` leaves the
name out, a C-extension field that is not there), and the download step
uses its cache and tells an unreachable registry from a missing version.

The ``slow`` test downloads (once; cached under
``~/.cache/camp2p-overlap/torch-npu-wheels``, or ``$CAMP2P_TORCH_NPU_WHEELS``)
the torch-npu builds the supported stacks pin and checks every row of the
script's table against each; it skips, saying why, when the registry cannot
be reached (docs/validation.md, "torch_npu's API from its wheels")."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from camp2p_overlap.core.patching.torch_npu_capture import BUILDS as CAPTURE_BUILDS
from camp2p_overlap.core.patching.torch_npu_capture import judge_capture_fix

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_torch_npu_api.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_torch_npu_api", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


api = _load()
Expect = api.Expect

# -- a synthetic wheel --------------------------------------------------------

STREAMS = """
import torch_npu._C

__all__ = ["Stream", "Event"]


class _Base:
    def synchronize(self):
        pass


class Stream(torch_npu._C._NPUStreamBase):
    def __new__(cls, device=None, priority=0, **kwargs):
        return super().__new__(cls)

    def wait_event(self, event):
        event.wait(self)


class Event(_Base):
    def __new__(cls, enable_timing=False, blocking=False):
        return super().__new__(cls)

    def record(self, stream=None):
        pass

    def elapsed_time(self, end_event):
        return 0.0
"""

UTILS = """
def stream(stream):
    return stream


def set_stream(stream):
    pass


def current_stream(device=None):
    pass


def _private():
    pass
"""

GRAPHS = """
__all__ = ["graph", "NPUGraph"]


class NPUGraph:
    def capture_begin(self, pool=None, capture_error_mode="global"):
        pass

    def replay(self):
        pass


class graph:
    def __init__(self, npu_graph, pool=None, stream=None, capture_error_mode="global"):
        pass

    def __enter__(self):
        pass

    def __exit__(self, exc_type, exc_value, traceback):
        pass


def graph_pool_handle():
    pass
"""

NPU_INIT = """
from .utils import stream, set_stream, current_stream
from .streams import Stream, Event
from .graphs import *
from .config import *

try:
    from .missing_module import nothing
except ImportError:
    pass


def mem_get_info(device=None):
    return (0, 0)
"""

CONFIG = """
def set_stream_limit(stream, cube_num=-1, vector_num=-1):
    pass
"""

#: A fake libtorch_npu.so: NUL-delimited names as pybind11 lays them out.
LIB = (
    b"\x7fELF junk\0_NPUStreamBase\0priority\0\0_NPUDeviceProperties\0\0cube_core_num\0vector_core_num\0L2_cache_size\0"
    + b"x" * 4096
    + b"\0ProfilerActivity\0CPU\0NPU\0"
)


def make_wheel(tmp_path: Path, **overrides: str | bytes | None) -> Path:
    """A zip shaped like a torch_npu wheel; ``overrides`` (path with / as __) replace or drop (None) a file."""
    files: dict[str, str | bytes | None] = {
        "torch_npu/__init__.py": "import torch_npu.npu\n",
        "torch_npu/version.py": "__version__ = '9.9.9'\ngit_version = 'abcdef1234567'\n",
        "torch_npu/npu/__init__.py": NPU_INIT,
        "torch_npu/npu/streams.py": STREAMS,
        "torch_npu/npu/utils.py": UTILS,
        "torch_npu/npu/graphs.py": GRAPHS,
        "torch_npu/npu/config.py": CONFIG,
        "torch_npu/lib/libtorch_npu.so": LIB,
        "torch_npu/_C.cpython-311-aarch64-linux-gnu.so": b"\x7fELF",
        "torch_npu-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch-npu\nVersion: 9.9.9\n",
    }
    for key, value in overrides.items():
        files[key.replace("__SLASH__", "/")] = value
    path = tmp_path / "torch_npu-9.9.9-cp311-cp311-manylinux_2_28_aarch64.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, content in files.items():
            if content is not None:
                z.writestr(name, content)
    return path


def _o(path: str, content: str | bytes | None) -> dict[str, str | bytes | None]:
    return {path.replace("/", "__SLASH__"): content}


ROWS = (
    Expect("torch.npu.Stream", "t", "class", 0, ("device",)),
    Expect("torch.npu.Stream.wait_event", "t", "method", 1),
    Expect("torch.npu.Event", "t", "class", 0, ("enable_timing",)),
    Expect("torch.npu.Event.record", "t", "method", 1),
    Expect("torch.npu.Event.elapsed_time", "t", "method", 1),
    Expect("torch.npu.Event.synchronize", "t", "method", 0),  # inherited from a Python base
    Expect("torch.npu.current_stream", "t", "function", 0),
    Expect("torch.npu.set_stream", "t", "function", 1),
    Expect("torch.npu.stream", "t", "function", 1),
    Expect("torch.npu.graph", "t", "class", 1, ("pool", "stream")),
    Expect("torch.npu.graph.__exit__", "t", "method", 3),
    Expect("torch.npu.NPUGraph.capture_begin", "t", "method", 0, ("pool", "capture_error_mode")),
    Expect("torch.npu.mem_get_info", "t", "function", 0),
    Expect("torch.npu.set_stream_limit", "t", "function", 1, ("cube_num", "vector_num")),
    Expect("torch_npu.version.git_version", "t", "assign"),
    Expect("x.cube", "t", "c-string", strings=("cube_core_num", "vector_core_num"), anchor="_NPUDeviceProperties"),
    Expect("x.activity", "t", "c-string", strings=("CPU", "NPU"), anchor="ProfilerActivity"),
)


def _by_label(report: object) -> dict[str, object]:
    return {r.label: r for r in report.results}  # type: ignore[attr-defined]


# -- fast tests: the checker ---------------------------------------------------


def test_every_row_found_in_a_good_wheel(tmp_path: Path) -> None:
    report = api.check_wheel(make_wheel(tmp_path), ROWS)
    bad = [(r.label, r.status, r.detail) for r in report.results if r.status not in (api.FOUND, api.FOUND_C)]
    assert bad == []
    assert report.ok
    assert report.version == "9.9.9" and report.git_version == "abcdef1234567"
    rows = _by_label(report)
    record_line = STREAMS.splitlines().index("    def record(self, stream=None):") + 1
    assert rows["torch.npu.Event.record(a0)"].defined_at == f"torch_npu/npu/streams.py:{record_line}"
    assert rows["torch.npu.Event.record(a0)"].signature == "record(self, stream=None)"
    assert rows["torch.npu.Event.synchronize()"].detail == "inherited from _Base"
    assert rows["torch.npu.graph(a0, pool=..., stream=...)"].signature.startswith("__init__(self, npu_graph,")
    assert rows["x.cube"].status == api.FOUND_C and "libtorch_npu.so" in rows["x.cube"].defined_at


def test_a_removed_name_is_missing_and_fails(tmp_path: Path) -> None:
    utils = UTILS.replace("def set_stream(stream):\n    pass\n", "")
    report = api.check_wheel(make_wheel(tmp_path, **_o("torch_npu/npu/utils.py", utils)), ROWS)
    rows = _by_label(report)
    assert rows["torch.npu.set_stream(a0)"].status == api.MISSING
    assert not report.ok
    assert [r.label for r in report.failures] == ["torch.npu.set_stream(a0)"]


def test_a_signature_that_lost_a_parameter_differs(tmp_path: Path) -> None:
    streams = STREAMS.replace(
        "def __new__(cls, enable_timing=False, blocking=False)", "def __new__(cls, blocking=False)"
    )
    report = api.check_wheel(make_wheel(tmp_path, **_o("torch_npu/npu/streams.py", streams)), ROWS)
    row = _by_label(report)["torch.npu.Event(enable_timing=...)"]
    assert row.status == api.DIFFERS
    assert "has no parameter enable_timing" in row.detail
    assert not report.ok


def test_a_signature_that_requires_more_differs(tmp_path: Path) -> None:
    streams = STREAMS.replace("def wait_event(self, event):", "def wait_event(self, event, flags):")
    graphs = GRAPHS.replace("def __init__(self, npu_graph, pool=None,", "def __init__(self, npu_graph, /, pool=None,")
    wheel = make_wheel(tmp_path, **_o("torch_npu/npu/streams.py", streams), **_o("torch_npu/npu/graphs.py", graphs))
    rows = _by_label(api.check_wheel(wheel, ROWS))
    assert rows["torch.npu.Stream.wait_event(a0)"].status == api.DIFFERS
    assert "requires flags" in rows["torch.npu.Stream.wait_event(a0)"].detail
    # positional-only npu_graph is fine: we pass it positionally
    assert rows["torch.npu.graph(a0, pool=..., stream=...)"].status == api.FOUND


def test_too_many_positional_arguments_differ(tmp_path: Path) -> None:
    rows = (
        Expect("torch.npu.stream", "t", "function", 2),
        Expect("torch.npu.Event", "t", "class", 1, ("enable_timing",)),
    )
    report = api.check_wheel(make_wheel(tmp_path), rows)
    got = {r.label: (r.status, r.detail) for r in report.results}
    assert got["torch.npu.stream(a0, a1)"][0] == api.DIFFERS
    assert "at most 1 positional" in got["torch.npu.stream(a0, a1)"][1]
    assert got["torch.npu.Event(a0, enable_timing=...)"][0] == api.DIFFERS
    assert "enable_timing given twice" in got["torch.npu.Event(a0, enable_timing=...)"][1]


def test_star_import_follows_all(tmp_path: Path) -> None:
    graphs = GRAPHS.replace('__all__ = ["graph", "NPUGraph"]', '__all__ = ["NPUGraph"]')
    rows = _by_label(api.check_wheel(make_wheel(tmp_path, **_o("torch_npu/npu/graphs.py", graphs)), ROWS))
    assert rows["torch.npu.graph(a0, pool=..., stream=...)"].status == api.MISSING
    assert rows["torch.npu.NPUGraph.capture_begin(pool=..., capture_error_mode=...)"].status == api.FOUND
    # a star import without __all__ exports public names only
    assert rows["torch.npu.set_stream_limit(a0, cube_num=..., vector_num=...)"].status == api.FOUND


def test_a_method_of_a_c_extension_base(tmp_path: Path) -> None:
    rows = (
        Expect("torch.npu.Stream.query", "t", "method", 0),  # not in Python, not a string of the library: missing
        Expect("torch.npu.Stream.priority", "t", "method", 0),  # a string of the library: found-c
    )
    report = api.check_wheel(make_wheel(tmp_path), rows)
    assert [r.status for r in report.results] == [api.MISSING, api.FOUND_C]
    assert "torch_npu._C._NPUStreamBase.query" in report.results[0].detail


def test_a_c_extension_field_not_there(tmp_path: Path) -> None:
    lib = LIB.replace(b"vector_core_num", b"vector_core_cnt")
    rows = (
        Expect("x.cube", "t", "c-string", strings=("cube_core_num", "vector_core_num"), anchor="_NPUDeviceProperties"),
        Expect("x.far", "t", "c-string", strings=("CPU",), anchor="_NPUDeviceProperties"),  # 4 KiB away: not near
        Expect("x.opt", "t", "c-string", optional=True, strings=("nope",), anchor="ProfilerActivity"),
    )
    report = api.check_wheel(make_wheel(tmp_path, **_o("torch_npu/lib/libtorch_npu.so", lib)), rows)
    assert [r.status for r in report.results] == [api.MISSING, api.MISSING, api.MISSING]
    assert [r.label for r in report.failures] == ["x.cube", "x.far"]  # the optional row fails nothing


def test_a_function_found_where_a_class_is_expected(tmp_path: Path) -> None:
    rows = (Expect("torch.npu.mem_get_info", "t", "class", 0),)
    report = api.check_wheel(make_wheel(tmp_path), rows)
    assert report.results[0].status == api.KIND_DIFFERS


def test_call_problems() -> None:
    import ast

    fn = ast.parse("def f(self, a, /, b, c=1, *, d, e=2, **kw): pass").body[0]
    p = api.params_of(fn, bound=True)
    assert p.positional == ("a", "b", "c") and p.required == frozenset({"a", "b", "d"})
    assert api.call_problems(p, 2, ("d",)) == []
    assert api.call_problems(p, 2, ("d", "zzz")) == []  # **kw takes it
    assert api.call_problems(p, 1, ("a", "b", "d")) == ["a is positional-only"]
    assert api.call_problems(p, 4, ("d",)) == ["takes at most 3 positional argument(s), we pass 4"]
    assert api.call_problems(p, 2, ()) == ["requires d, which we do not pass"]
    static = ast.parse("@staticmethod\ndef g(x): pass").body[0]
    assert api.params_of(static, bound=True).positional == ("x",)


def test_the_table_is_well_formed() -> None:
    kinds = {"function", "class", "method", "assign", "c-string"}
    for e in api.EXPECTED:
        assert e.kind in kinds, e
        assert e.name.startswith(("torch.npu.", "torch_npu.")), e
        assert e.where, e
        if e.kind == "c-string":
            assert e.strings and e.anchor, e
    required = {e.name for e in api.EXPECTED if not e.optional}
    assert {"torch.npu.Event.record", "torch.npu.Stream.wait_event", "torch.npu.graph"} <= required


def test_main_writes_json_and_exits_by_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "EXPECTED", ROWS)
    good = make_wheel(tmp_path)
    out = tmp_path / "out" / "api.json"
    assert api.main(["--wheel", str(good), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["builds"][0]["wheel"] == good.name
    assert len(data["builds"][0]["sha256"]) == 64
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = make_wheel(bad_dir, **_o("torch_npu/npu/graphs.py", GRAPHS.replace("def capture_begin(", "def begin(")))
    assert api.main(["--wheel", str(bad), "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    failing = [r["label"] for r in data["builds"][0]["results"] if r["status"] in api.FAILING and not r["optional"]]
    assert failing == ["torch.npu.NPUGraph.capture_begin(pool=..., capture_error_mode=...)"]


# -- fast tests: the download step ------------------------------------------------


def test_a_cached_wheel_is_not_downloaded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = make_wheel(tmp_path)

    def no_pip(*a: object, **k: object) -> None:
        raise AssertionError("pip was run although the wheel is cached")

    monkeypatch.setattr(api.subprocess, "run", no_pip)
    assert api.ensure_wheel("9.9.9", tmp_path) == cached


@pytest.mark.parametrize(
    ("output", "error"),
    [
        (
            "WARNING: Retrying ... 'NewConnectionError(...: Failed to establish a new connection')",
            "RegistryUnreachable",
        ),
        ("ERROR: No matching distribution found for torch-npu==0.0.1", "WheelUnavailable"),
    ],
)
def test_download_failures_are_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, error: str
) -> None:
    def fake_run(cmd: list[str], **k: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--only-binary=:all:" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", output)

    monkeypatch.setattr(api.subprocess, "run", fake_run)
    with pytest.raises(api.WheelUnavailable) as info:
        api.ensure_wheel("0.0.1", tmp_path / "cache")
    assert type(info.value).__name__ == error


# -- slow: the real wheels ------------------------------------------------------

_CAPTURE_TAG = {b.version: b for b in CAPTURE_BUILDS}


@pytest.mark.slow
@pytest.mark.parametrize("build", api.BUILDS, ids=lambda b: b.version)
def test_real_wheel_has_every_name_we_call(build: object) -> None:
    cache = Path(os.environ.get("CAMP2P_TORCH_NPU_WHEELS", str(api.DEFAULT_CACHE))).expanduser()
    try:
        path = api.ensure_wheel(build.version, cache)  # type: ignore[attr-defined]
    except api.RegistryUnreachable as exc:
        network = [ln for ln in str(exc).splitlines() if api._NETWORK.search(ln)] or str(exc).splitlines()
        pytest.skip(
            f"torch-npu {build.version} is not in {cache} and the package registry cannot be reached "  # type: ignore[attr-defined]
            f"(pip download: {network[-1].strip()[:200]})"
        )
    report = api.check_wheel(path, stack=build.stack)  # type: ignore[attr-defined]
    print(api.format_report(report))
    assert report.failures == [], api.format_report(report)
    assert report.version == build.version  # type: ignore[attr-defined]
    # The build's commit is the one camp2p_overlap's capture-fix table records for a tag of that version.
    tags = [b for b in CAPTURE_BUILDS if b.version == build.version and b.commit == report.git_version]  # type: ignore[attr-defined]
    assert tags, f"git_version {report.git_version} is no release tag of {build.version} in torch_npu_capture.BUILDS"
    verdict = judge_capture_fix(report.version, report.git_version)
    assert verdict.fixed == tags[0].fixed
    rows = {r.name: r for r in report.results}
    for name in (
        "torch_npu._C._NPUDeviceProperties.cube_core_num",
        "torch_npu._C._NPUDeviceProperties.vector_core_num",
        "torch.npu.set_stream_limit",
        "torch.npu.get_stream_limit",
    ):
        assert rows[name].status in (api.FOUND, api.FOUND_C), (name, rows[name])
