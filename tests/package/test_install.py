"""The built wheel, installed into a fresh virtual environment: importing
the package imports no vLLM / afd-plugin / torch_npu module, the manifest
loads from the wheel, and the vLLM entry point is in its metadata. The
sdist holds the manifests as files, and the checkout reaches them through
its one link ``camp2p_overlap/patches -> ../patches``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
from pathlib import Path

import pytest
from support.child import PROGRAMS, REPO

#: What the fresh venv reports about the installed wheel.
CHILD = PROGRAMS / "installed_wheel_report.py"


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("install")
    # Build from a copy so the build leaves nothing in the checkout.
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "LICENSE", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    # Links kept: the build itself must follow camp2p_overlap/patches -> ../patches.
    shutil.copytree(REPO / "camp2p_overlap", src / "camp2p_overlap", ignore=ignore, symlinks=True)
    shutil.copytree(REPO / "patches", src / "patches", ignore=ignore)
    assert (src / "camp2p_overlap" / "patches").is_symlink()
    dist = tmp / "dist"
    sdist = _run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(dist)!r}))"],
        cwd=str(src),
    ).stdout.split()[-1]
    with tarfile.open(dist / sdist) as tar:
        sdist_files = {m.name.split("/", 1)[1]: m.isfile() for m in tar.getmembers() if "/" in m.name}
    wheels = tmp / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        cwd=str(tmp),
    )
    (wheel,) = wheels.glob("camp2p_overlap-*.whl")

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # The dependencies (wrapt, packaging, torch) come from this venv's site-packages,
    # added as a plain path: its .pth files (our editable install) are not processed.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    _run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        cwd=str(tmp),
    )
    clean_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp)}
    proc = _run([str(py), str(CHILD)], cwd=str(tmp), env=clean_env)
    out = json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("OUT ")))
    out["env_dir"] = str(env_dir)
    out["sdist_files"] = sdist_files
    return out


def test_import_pulls_in_no_upstream_module(installed: dict) -> None:
    assert installed["imported"] == []


def test_the_installed_copy_is_the_wheel(installed: dict) -> None:
    env_dir = Path(installed["env_dir"]).resolve()
    assert Path(installed["prefix"]).resolve() == env_dir
    assert Path(installed["package"]).resolve().is_relative_to(env_dir)


def test_manifest_ships_inside_the_wheel(installed: dict) -> None:
    assert Path(installed["manifest_dir"]).resolve().is_relative_to(Path(installed["env_dir"]).resolve())
    assert "camp2p_overlap/patches/vllm-0.19.1.toml" in installed["dist_files"]
    assert "camp2p_overlap/patches/vllm-0.26.0.toml" in installed["dist_files"]
    assert installed["stacks"] == ["vllm-0.19.1", "vllm-0.26.0"]
    assert installed["stack"] == "vllm-0.19.1" and installed["targets"] == 5


def test_manifests_ship_inside_the_sdist(installed: dict) -> None:
    files = installed["sdist_files"]
    for name in ("__init__.py", "README.md", "vllm-0.19.1.toml", "vllm-0.26.0.toml"):
        assert files.get(f"camp2p_overlap/patches/{name}") is True, name  # a regular file, not a link


def test_the_checkout_reads_the_manifests_through_one_link() -> None:
    """One way to the manifests: the package ``camp2p_overlap.patches`` is
    the link to the top-level ``patches/`` (a copied folder would drift)."""
    from importlib import resources

    link = REPO / "camp2p_overlap" / "patches"
    assert link.is_symlink() and os.readlink(link) == "../patches"
    assert link.resolve() == (REPO / "patches").resolve()
    assert Path(str(resources.files("camp2p_overlap.patches"))).resolve() == (REPO / "patches").resolve()


def test_entry_point_is_in_the_wheel_metadata(installed: dict) -> None:
    assert ["vllm.general_plugins", "camp2p_overlap", "camp2p_overlap:register"] in installed["entry_points"]


def test_standins_ship_inside_the_wheel(installed: dict) -> None:
    # The benchmark (the main job) imports the stand-ins from the installed package.
    assert installed["standin_classes"] == ["AFDNPUFFNModelRunner", "CAMP2pAFDConnector"]
    assert Path(installed["standin_file"]).resolve().is_relative_to(Path(installed["env_dir"]).resolve())
    main = Path(installed["main_runner_file"]).resolve()  # afd-plugin main's runner, for the vllm-0.26.0 stack
    assert main.name == "ffn_model_runner_main.py" and main.is_relative_to(Path(installed["env_dir"]).resolve())
    wanted = "camp2p_overlap/emulation/standins/afd_plugin/v1/worker/npu/ffn_model_runner.py"
    assert wanted in installed["dist_files"]


def test_nothing_shipped_or_documented_points_outside_the_project() -> None:
    """Shipped code, docs, manifests and tests cite the project's own
    ``docs/``; the steering folder ``shared/`` does not exist for users."""
    roots = [REPO / "camp2p_overlap", REPO / "docs", REPO / "patches", REPO / "tests", REPO / "scripts"]
    files = [p for root in roots for p in root.rglob("*") if p.suffix in (".py", ".md", ".toml", ".sh")]
    files += [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "pyproject.toml"]
    needles = ("shared/design", "shared/contracts", "shared/seed", "../shared")
    this = Path(__file__).resolve()
    hits = [
        f"{p.relative_to(REPO)}: {n}"
        for p in files
        if p.resolve() != this
        for n in needles
        if n in p.read_text(encoding="utf-8")
    ]
    assert len(files) > 50
    assert hits == []
