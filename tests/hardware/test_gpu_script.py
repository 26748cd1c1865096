"""A CPU rehearsal of ``scripts/gpu_check.sh``: its set-up path runs here as
it would on the GPU box, with a fake ``nvidia-smi`` on PATH. The script runs
with a throwaway virtual environment that sees this one's packages (torch,
pip, setuptools) but installs into itself, so the offline editable install
(``pip install --no-deps --no-build-isolation --no-index -e .``), the carried
wheels (``--target`` into a site folder put first on PYTHONPATH), the wrapt
check and the import of the manifests all really run. Then:

* nvidia-smi sees a GPU and torch cannot use it (CPU torch): failed, exit 1;
* nvidia-smi sees no GPU: skipped, exit 0;
* no Python that imports torch, with a GPU seen: failed;
* a carried wrapt older than 2.5 shadowing the good one: failed;
* a carried setuptools older than pyproject.toml's build requirement: the
  editable install fails, the checkout is used through PYTHONPATH and the
  summary says so (setup and warnings), not silently.

Past the device check (``torch.cuda.is_available()`` made to answer True):
the parts run within the budget and their limits, clipped to what is left;
a part that outlives its limit gets SIGINT, so pytest still writes its JUnit
XML and its failures, and the summary says the part was cut (with SIGKILL
after the grace, the outcomes come from pytest's -v log); a provisional
summary (status "running") is there while a part runs. The default limits
leave the set-up its allowance, and the pinned wheels of
``scripts/gpu_wheels.sh`` meet pyproject.toml.

Also: the manifests load from a source checkout used without installing
(through the package ``camp2p_overlap.patches``, the checkout's link to
``patches/``), so a missing install cannot make every GPU test and child
process fail with ``ModuleNotFoundError``; a copy that lost the link says so."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
from support.child import REPO, run_program

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

SCRIPT = REPO / "scripts" / "gpu_check.sh"
WHEELS_SCRIPT = REPO / "scripts" / "gpu_wheels.sh"
PARTS = ("pytest", "bench", "graph", "layouts", "sweep", "overhead")
#: The most files the device tool hands back from $OUT (docs/validation.md).
MAX_OUT_FILES = 8

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")


def _venv(path: Path, *, see_this_env: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    py = path / "bin" / "python"
    if see_this_env:
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        Path(site, "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _fake_smi(bindir: Path, gpu: bool) -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    body = (
        'case "$1" in -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-fake)";; '
        '*) echo "name, driver_version"; echo "NVIDIA H200, 580.00";; esac'
        if gpu
        else 'echo "No devices were found"; exit 6'
    )
    smi = bindir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)


def _wheel(folder: Path, name: str, version: str, code: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", code)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def _purelib(py: Path) -> Path:
    return Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )


def _pretend_cuda_venv(path: Path) -> Path:
    """A throwaway environment whose start-up hook makes
    ``torch.cuda.is_available()`` answer True while CAMP2P_TEST_PRETEND_CUDA
    is set: the script goes past its device check and runs its parts."""
    py = _venv(path, see_this_env=True)
    (_purelib(py) / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('CAMP2P_TEST_PRETEND_CUDA'):\n"
        "    import torch\n"
        "    torch.cuda.is_available = lambda: True\n"
    )
    return py


def _env(tmp: Path, *, python: Path, gpu: bool | None, wheels: Path | None = None, **extra: str) -> dict[str, str]:
    out = tmp / "out"
    bindir = tmp / "bin"
    path = os.environ["PATH"]
    if gpu is not None:
        _fake_smi(bindir, gpu)
        path = f"{bindir}{os.pathsep}{path}"
    else:  # no nvidia-smi at all: PATH without any folder that has one
        path = os.pathsep.join(d for d in path.split(os.pathsep) if not Path(d, "nvidia-smi").exists())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CAMP2P", "PYTHON"))}
    env.update(
        PATH=path,
        PYTHON=str(python),
        OUT=str(out),
        WHEELS=str(wheels or tmp / "no-wheels"),
        SITE=str(tmp / "site"),
        GPU_CHECK_BUDGET_S="120",
    )
    env.update(extra)
    return env


def _run(
    tmp: Path, *, python: Path, gpu: bool | None, wheels: Path | None = None, timeout_s: int = 150, **extra: str
) -> tuple[int, dict, Path]:
    out = tmp / "out"
    env = _env(tmp, python=python, gpu=gpu, wheels=wheels, **extra)
    res = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=timeout_s, cwd=str(tmp)
    )
    summary = json.loads((out / "gpu_check.json").read_text())
    assert json.loads(res.stdout.strip().splitlines()[-1])["status"] == summary["status"], res.stdout + res.stderr
    return res.returncode, summary, out


def test_gpu_seen_but_torch_cannot_use_it_fails_after_the_offline_set_up(tmp_path: Path) -> None:
    py = _venv(tmp_path / "venv", see_this_env=True)
    wheels = tmp_path / "wheels"
    _wheel(wheels, "camp2p_carried_marker", "1.0", "CARRIED = True\n")
    rc, s, out = _run(tmp_path, python=py, gpu=True, wheels=wheels)
    assert rc == 1 and s["status"] == "failed", s
    assert s["gpu_seen_by_nvidia_smi"] is True
    assert "nvidia-smi sees a GPU, but torch" in s["reason"] and "cannot use it" in s["reason"], s["reason"]
    setup = s["setup"]
    assert setup["install"] == "editable", setup
    # What imports is the editable install (checked from outside the checkout, without it on PYTHONPATH).
    assert setup["import_via"] == "editable install", setup
    assert setup["import_from"] == str(REPO.resolve() / "camp2p_overlap" / "__init__.py")
    assert setup["setuptools"].endswith(": meets setuptools>=77"), setup
    assert s["warnings"] == [], s["warnings"]
    assert setup["import"] == "ok" and setup["wheels"] == 1 and setup["site"] == str(tmp_path / "site")
    assert (tmp_path / "site" / "camp2p_carried_marker" / "__init__.py").exists()
    assert tuple(int(x) for x in setup["wrapt"].split(".")[:2]) >= (2, 5)
    # The editable install went into the throwaway environment, not this one.
    assert list(_purelib(py).glob("__editable__*camp2p_overlap*"))
    assert any("NVIDIA H200" in line for line in s["env"]), s["env"]
    assert not (out / "env.txt").exists(), "the environment report is in the summary, not a file of $OUT"
    assert "manifests ['vllm-0.19.1', 'vllm-0.26.0']" in (out / "tools.log").read_text()
    assert s["parts"]["pytest"].get("rc") is None  # no part ran


def test_no_gpu_seen_skips(tmp_path: Path) -> None:
    py = _venv(tmp_path / "venv", see_this_env=True)
    rc, s, _ = _run(tmp_path, python=py, gpu=False)
    assert rc == 0 and s["status"] == "skipped", s
    assert "nvidia-smi sees no GPU" in s["reason"]
    assert s["gpu_seen_by_nvidia_smi"] is False


def test_no_nvidia_smi_and_no_torch_skips(tmp_path: Path) -> None:
    bare = _venv(tmp_path / "bare", see_this_env=False)
    rc, s, _ = _run(tmp_path, python=bare, gpu=None)
    assert rc == 0 and s["status"] == "skipped", s
    assert "no Python here imports torch" in s["reason"]


def test_gpu_seen_and_no_torch_fails(tmp_path: Path) -> None:
    bare = _venv(tmp_path / "bare", see_this_env=False)
    rc, s, _ = _run(tmp_path, python=bare, gpu=True)
    assert rc == 1 and s["status"] == "failed", s
    assert "no Python here imports torch" in s["reason"]


def test_an_old_wrapt_fails_the_set_up(tmp_path: Path) -> None:
    py = _venv(tmp_path / "venv", see_this_env=True)
    wheels = tmp_path / "wheels"
    _wheel(wheels, "wrapt", "1.17.0", "__version__ = '1.17.0'\n")
    rc, s, _ = _run(tmp_path, python=py, gpu=True, wheels=wheels)
    assert rc == 1 and s["status"] == "failed", s
    assert "wrapt>=2.5 is needed, found 1.17.0" in s["reason"]


def test_an_old_setuptools_is_reported_and_the_fallback_is_not_silent(tmp_path: Path) -> None:
    """A carried setuptools older than the build requirement (a stand-in
    without ``build_meta``) goes first on PYTHONPATH: the check names it, the
    editable install fails, the checkout is imported through PYTHONPATH, and
    the summary says all of it (setup, warnings, the final reason)."""
    py = _venv(tmp_path / "venv", see_this_env=True)
    wheels = tmp_path / "wheels"
    _wheel(wheels, "setuptools", "60.0.0", "__version__ = '60.0.0'\n")
    rc, s, _ = _run(tmp_path, python=py, gpu=True, wheels=wheels)
    assert rc == 1 and "cannot use it" in s["reason"], s  # the set-up went on to the device check
    setup = s["setup"]
    assert setup["setuptools"] == f"60.0.0 at {tmp_path / 'site'}: does not meet setuptools>=77", setup
    assert setup["install"].startswith("failed (pip exit "), setup
    assert setup["import_via"] == f"PYTHONPATH={REPO}" and setup["import"] == "ok", setup
    assert setup["import_from"] == str(REPO.resolve() / "camp2p_overlap" / "__init__.py")
    assert len(s["warnings"]) == 2, s["warnings"]
    assert "does not meet setuptools>=77" in s["warnings"][0] and "scripts/gpu_wheels.sh" in s["warnings"][0]
    assert "the parts import the checkout through PYTHONPATH" in s["warnings"][1]
    assert "warnings: " in s["reason"] and "through PYTHONPATH" in s["reason"], s["reason"]
    assert not list(_purelib(py).glob("__editable__*camp2p_overlap*"))


def test_manifests_load_from_a_checkout_that_is_not_installed() -> None:
    res = run_program("manifests_from_checkout.py", str(REPO), timeout=60)
    assert res.returncode == 0, res.stderr
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith(("SPEC", "LOADED")))
    # The package the wheel ships, here the checkout's link to patches/.
    assert lines["SPEC"] == str(REPO / "camp2p_overlap" / "patches" / "__init__.py")
    assert lines["LOADED"] == "vllm-0.19.1 ['vllm-0.19.1', 'vllm-0.26.0']"


def test_a_checkout_copy_without_the_manifest_link_says_so(tmp_path: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "camp2p_overlap", tmp_path / "camp2p_overlap", ignore=ignore, symlinks=True)
    (tmp_path / "camp2p_overlap" / "patches").unlink()  # what a copy that drops links leaves
    res = run_program("manifests_from_checkout.py", str(tmp_path), timeout=60)
    assert res.returncode != 0
    assert "the manifests are missing: camp2p_overlap.patches is not importable" in res.stderr, res.stderr[-2000:]


def _script_cli_parts() -> dict[str, list[str]]:
    """The camp2p-overlap command lines of the script's parts, by part name
    (``run_part NAME``), as written there (continuation lines joined,
    ``$OUT/x`` kept as ``x``)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    parts = {}
    for line in text.splitlines():
        m = re.search(r'^run_part (\w+) \S+ "\$\{CLI\[@\]\}" (bench|sweep|overhead) (.*)$', line)
        if m:
            args = shlex.split(m.group(3))
            args = [re.sub(r"^\$\{(\w+):-([^}]*)\}$", r"\2", a).replace("$OUT/", "") for a in args]
            parts[m.group(1)] = [m.group(2), *args]
    return parts


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is here: the script runs for real")
def test_the_scripts_command_lines_pass_validation_and_stop_only_for_the_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every tool the script runs on cuda takes its flags here: without a GPU
    it stops at the device check (exit 2, "no CUDA device"), never at a
    parameter; overhead needs no device and is covered by its own tests."""
    from camp2p_overlap.tools import cli

    parts = _script_cli_parts()
    assert set(parts) == {"bench", "graph", "sweep", "overhead"}, parts
    assert parts["graph"][0] == "bench" and "--graph" in parts["graph"], parts["graph"]
    # the bench part: the contention model off and on, side by side, every default policy (both layouts)
    bench = parts["bench"]
    assert bench[bench.index("--comm-cores-sweep") + 1] == "0,8" and "--policies" not in bench, bench
    assert parts["graph"][parts["graph"].index("--json") + 1] == "bench_graph_cuda.json"
    for name in ("bench", "graph", "sweep"):
        argv = parts[name]
        assert argv[argv.index("--device") + 1] == "cuda"
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "--device cuda: torch.cuda reports no CUDA device" in err, (argv, err)
    assert parts["overhead"][1:] == ["--ab-pairs", "20", "--json", "overhead.json"]
    args = cli.build_parser().parse_args(parts["overhead"])  # the flags exist; the run is covered below
    assert (args.ab_pairs, args.json) == (20, "overhead.json")


def test_the_gpu_test_files_collect_without_what_the_gpu_box_lacks() -> None:
    """The script runs pytest -m gpu on the files that hold gpu-marked tests
    (found as it finds them); on the GPU box there is no vLLM, no grimp or
    import-linter, no hypothesis: those files must import without them."""
    files = sorted(str(p) for p in (REPO / "tests").rglob("test_*.py") if re.search(r"mark\.gpu", p.read_text()))
    assert "test_gpu_validation.py" in " ".join(files)
    res = run_program("collect_like_the_gpu_box.py", *files, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "error" not in res.stdout.lower().split("collected")[-1], res.stdout[-3000:]
    assert "test_cuda_tensor_ownership_without_record_stream" in res.stdout


def test_the_parts_run_within_the_budget_and_the_summary_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script past its device check, on this CPU machine: a start-up hook
    of the throwaway environment makes ``torch.cuda.is_available()`` answer
    True, so every part runs and the cuda ones fail fast (there is no CUDA).
    What is checked is the plumbing: each part ran under its limit, the
    summary read the JUnit counts of the gpu test files, the exit codes and
    the overhead figures (that command needs no device and passes)."""
    py = _pretend_cuda_venv(tmp_path / "venv")
    monkeypatch.setenv("OVERHEAD_AB_PAIRS", "20")  # the decided-serial A/B's plumbing, not its figure
    os.environ["CAMP2P_TEST_PRETEND_CUDA"] = "1"
    try:
        # Five parts on a shared CPU, which a busy machine may slow several times over (set-up 25-60 s):
        # a budget that leaves every part its limit, pytest's asked above the budget (so always clipped),
        # and overhead's (about 20 s) with room.
        budget = {"GPU_CHECK_BUDGET_S": "400", "PYTEST_LIMIT": "1000", "OVERHEAD_LIMIT": "150"}
        rc, s, out = _run(tmp_path, python=py, gpu=True, timeout_s=460, **budget)
    finally:
        del os.environ["CAMP2P_TEST_PRETEND_CUDA"]
    assert rc == 1 and s["status"] == "failed", s
    parts = s["parts"]
    gpu_files = [p for p in (REPO / "tests").rglob("test_*.py") if re.search(r"mark\.gpu", p.read_text())]
    assert parts["pytest"]["files"] == len(gpu_files) >= 3
    counts = parts["pytest"]["counts"]
    assert counts["tests"] >= 10 and counts["failures"] + counts["errors"] >= 1, counts
    assert parts["pytest"]["not_passed"], parts["pytest"]
    for name in ("bench", "graph", "layouts", "sweep"):
        assert parts[name]["rc"] not in (0, None), parts
    # the layouts part ran its child once per layout (each failed: there is no CUDA), read from tools.log
    layouts = parts["layouts"]["layouts"]
    assert set(layouts) == {"compute-side", "comm-side"} and all(rc != 0 for rc in layouts.values()), layouts
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= MAX_OUT_FILES, f"$OUT holds {len(files)} files, more than the device tool hands back: {files}"
    assert parts["overhead"]["rc"] == 0, (out / "tools.log").read_text()[-3000:]
    result = parts["overhead"]["result"]
    assert set(result) >= {"engaged_us_per_layer_stage", "passthrough_us_per_step", "passthrough_us_per_call"}
    ab = result["decided_serial_ab"]
    assert ab["pairs"] == 20 and set(ab["control"]) == set(ab["extra_pct"]) == {"median", "ci95", "min", "max"}
    plan = s["plan"]
    reserve = plan["kill_grace_s"] + plan["end_reserve_s"]
    for name in PARTS:
        p = parts[name]
        # Each limit is its own, clipped to what was left of the budget less the reserves.
        assert p["limit_s"] == min(p["asked_limit_s"], p["left_s"] - reserve), p
        assert p["seconds"] <= p["limit_s"] + plan["kill_grace_s"] and p["cut"] is False, p
    assert parts["pytest"]["asked_limit_s"] == plan["limits_s"]["pytest"]
    assert parts["pytest"]["limit_s"] < parts["pytest"]["asked_limit_s"]  # the budget clips it
    assert s["cut_by_limit"] == [] and "running" not in s
    assert "parts not passed: pytest" in s["reason"]
    assert s["seconds"] <= s["budget_s"]


_SLOW_TESTS = """
import os
import pathlib
import signal
import time

import pytest

pytestmark = pytest.mark.gpu


def test_passes():
    pass


def test_fails_with_details():
    got = {"ffn": 3}
    assert got == {"ffn": 4}, "a detail the log must keep"


def test_outlives_the_limit():
    if os.environ.get("IGNORE_SIGINT"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    pathlib.Path(os.environ["SLEEP_MARK"]).write_text("sleeping")
    time.sleep(120)
"""


@pytest.mark.parametrize("stops_on_sigint", [True, False], ids=["sigint", "sigkill-after-grace"])
def test_a_part_cut_by_its_limit_keeps_its_results_and_is_reported(tmp_path: Path, stops_on_sigint: bool) -> None:
    """Part 1 with a gpu test that outlives the part's limit. While it runs,
    gpu_check.json is the provisional summary (status "running", the part
    running). At the limit pytest gets SIGINT: it writes its JUnit XML (the
    tests that ended) and its failures in full; the summary marks the part
    cut. A part that ignores SIGINT is killed after the grace: no XML, so
    the outcomes come from the -v lines of its log."""
    py = _pretend_cuda_venv(tmp_path / "venv")
    tests = tmp_path / "gputests"
    tests.mkdir()
    (tests / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a gpu test\n")
    (tests / "test_slow.py").write_text(_SLOW_TESTS)
    mark = tmp_path / "sleeping"
    limit = 12
    # pytest stops at SIGINT in a second or two, more on a busy machine: the SIGINT case has a long
    # grace (it never waits it out), the SIGKILL case a short one (it waits it out).
    grace = 10 if stops_on_sigint else 3
    env = _env(
        tmp_path,
        python=py,
        gpu=True,
        CAMP2P_TEST_PRETEND_CUDA="1",
        GPU_CHECK_TESTS=str(tests / "test_slow.py"),
        GPU_CHECK_PARTS="pytest",
        PYTEST_LIMIT=str(limit),
        GPU_CHECK_KILL_GRACE_S=str(grace),
        SLEEP_MARK=str(mark),
        **({} if stops_on_sigint else {"IGNORE_SIGINT": "1"}),
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path)
    )
    try:
        deadline = time.monotonic() + 100
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mark.exists(), "the slow test never started"
        running = json.loads((out / "gpu_check.json").read_text())
        # While a part runs, $OUT holds only the files the run hands back (the environment report is not one).
        assert not (out / "env.txt").exists(), sorted(p.name for p in out.iterdir())
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert running["status"] == "running" and running["running"] == "pytest", running
    assert running["parts"]["pytest"]["limit_s"] == limit and running["setup"]["import"] == "ok", running
    assert proc.returncode == 1, stdout + stderr
    s = json.loads((out / "gpu_check.json").read_text())
    assert json.loads(stdout.strip().splitlines()[-1])["status"] == s["status"] == "failed"
    part = s["parts"]["pytest"]
    assert part["cut"] is True and s["cut_by_limit"] == ["pytest"], s
    assert "cut by their time limit: pytest" in s["reason"], s["reason"]
    assert all(s["parts"][p].get("selected") is False and "rc" not in s["parts"][p] for p in PARTS[1:]), s
    log = (out / "pytest_gpu.log").read_text()
    assert "test_slow.py::test_passes PASSED" in log and "test_slow.py::test_fails_with_details FAILED" in log
    if stops_on_sigint:
        assert part["rc"] == 124 and "(SIGINT)" in part["why"], part
        assert limit <= part["seconds"] < limit + grace, part
        assert part["counts"] == {"tests": 2, "failures": 1, "errors": 0, "skipped": 0, "passed": 1}, part
        assert len(part["not_passed"]) == 1 and "test_fails_with_details" in part["not_passed"][0], part
        assert "a detail the log must keep" in log and "KeyboardInterrupt" in log, log[-3000:]
    else:
        assert part["rc"] == 137 and "SIGKILL" in part["why"], part
        assert not (out / "pytest_gpu.xml").exists()
        assert part["outcomes_from_log"] == {"passed": 1, "failed": 1}, part
        (not_passed,) = part["not_passed"]
        assert not_passed.endswith("test_slow.py::test_fails_with_details: FAILED"), part


def test_the_default_limits_leave_the_set_up_its_allowance(tmp_path: Path) -> None:
    """The part limits, as the script sets them and as its header documents
    them, leave the set-up (pip, 3-4 cold ``import torch``: 20-60 s) its
    allowance and the kill grace and summary reserve within the budget."""
    bare = _venv(tmp_path / "bare", see_this_env=False)
    env = _env(tmp_path, python=bare, gpu=False)
    del env["GPU_CHECK_BUDGET_S"]
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60, cwd=str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    plan = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["plan"]
    assert plan["budget_s"] == 450 and set(plan["limits_s"]) == set(PARTS), plan
    assert plan["limits_sum_s"] == sum(plan["limits_s"].values()) <= 360, plan
    assert plan["setup_allowance_s"] >= 60, plan
    spare = plan["budget_s"] - plan["limits_sum_s"] - plan["kill_grace_s"] - plan["end_reserve_s"]
    assert spare >= plan["setup_allowance_s"], plan
    header = SCRIPT.read_text().split("\nset -u\n", 1)[0].replace("#", " ")
    documented = [int(x) for x in re.findall(r"limit (\d+) s", header)]
    assert documented == [plan["limits_s"][p] for p in PARTS], (documented, plan["limits_s"])
    assert f"default {plan['budget_s']} s" in header and f"add up to {plan['limits_sum_s']} s" in header
    assert f"SETUP_ALLOWANCE_S={plan['setup_allowance_s']}" in header


def _pins() -> dict[str, str]:
    """The wheels scripts/gpu_wheels.sh fetches by default: name -> pin."""
    text = WHEELS_SCRIPT.read_text()
    return dict(re.findall(r"^[A-Z]+=\$\{[A-Z]+:-([A-Za-z_.-]+)(==[^}]+)\}$", text, re.M))


def test_the_carried_wheels_meet_pyproject() -> None:
    """The pinned setuptools gpu_wheels.sh fetches meets pyproject.toml's
    [build-system] requires (the editable install on the GPU box builds with
    it), and the pinned wrapt meets the project's dependency."""
    from packaging.requirements import Requirement

    pins = _pins()
    assert set(pins) == {"setuptools", "wrapt"}, pins
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    build = [Requirement(r) for r in pyproject["build-system"]["requires"]]
    deps = [Requirement(r) for r in pyproject["project"]["dependencies"]]
    for name, reqs in (("setuptools", build), ("wrapt", deps)):
        (req,) = [r for r in reqs if r.name == name]
        version = pins[name].removeprefix("==")
        assert req.specifier.contains(version), f"{name}{pins[name]} (gpu_wheels.sh) does not meet {req}"


def _graph_layouts_function() -> str:
    """The script's ``graph_layouts`` function, as written there."""
    text = SCRIPT.read_text()
    m = re.search(r"^graph_layouts\(\) \{.*?^\}$", text, re.M | re.S)
    assert m, "scripts/gpu_check.sh has no graph_layouts function"
    return m.group(0)


@pytest.mark.parametrize("fail_comm_side", [False, True], ids=["both-pass", "comm-side-fails"])
def test_the_layouts_part_captures_each_layout_and_opts_comm_side_in_alone(
    tmp_path: Path, fail_comm_side: bool
) -> None:
    """Part 4 runs the graph child once per layout, configured from the environment as a vLLM worker is:
    compute-side with the layout left to its default and no comm-side opt-in, comm-side with
    VLLM_CAMP2P_MULTISTREAM_LAYOUT=comm-side and VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE=1 (which a decode graph
    of comm-side needs); each run's exit code is on a LAYOUT line, and the part fails when either run fails.
    Here a fake Python records each run's environment."""
    fake = tmp_path / "python"
    record = tmp_path / "runs.txt"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$* LAYOUT=${{VLLM_CAMP2P_MULTISTREAM_LAYOUT-unset}} '
        f"OPT_IN=${{VLLM_CAMP2P_MULTISTREAM_GRAPH_COMM_SIDE-unset}} GRAPH=$VLLM_CAMP2P_MULTISTREAM_GRAPH "
        f'ON=$VLLM_CAMP2P_MULTISTREAM ADAPTIVE=$VLLM_CAMP2P_MULTISTREAM_ADAPTIVE" >>{record}\n'
        + ('[ "$VLLM_CAMP2P_MULTISTREAM_LAYOUT" = comm-side ] && exit 3\n' if fail_comm_side else "")
        + "exit 0\n"
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CAMP2P")}
    res = subprocess.run(
        ["bash", "-c", _graph_layouts_function() + '\ngraph_layouts "$1"', "graph_layouts", str(fake)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO),
        timeout=30,
    )
    runs = record.read_text().splitlines()
    child = "tests/programs/gpu_overlap_child.py graph-env"
    assert runs == [
        f"{child} LAYOUT=unset OPT_IN=unset GRAPH=1 ON=1 ADAPTIVE=0",
        f"{child} LAYOUT=comm-side OPT_IN=1 GRAPH=1 ON=1 ADAPTIVE=0",
    ], runs
    assert (REPO / "tests" / "programs" / "gpu_overlap_child.py").exists()
    assert res.stdout.splitlines() == ["LAYOUT compute-side rc=0", f"LAYOUT comm-side rc={3 if fail_comm_side else 0}"]
    assert res.returncode == (1 if fail_comm_side else 0), res.stdout + res.stderr
