"""A fake torch_npu distribution on ``sys.path``: a ``torch_npu-<version>.dist-info``
(METADATA and, unless told otherwise, a RECORD) and a ``torch_npu/version.py``
holding ``__version__`` and ``git_version``, which raises if it is ever
imported (it must be read as text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from camp2p_overlap.core.patching import torch_npu_capture


class FakeTorchNpu:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.monkeypatch = monkeypatch
        self.made = 0

    def install(self, version: str, git_version: str | None, *, record: bool = True, reset: bool = True) -> Path:
        """Put a distribution of ``version`` first on sys.path (the read's
        cache reset unless ``reset`` is False); its site directory."""
        self.made += 1
        site = self.root / f"site{self.made}"
        info = site / f"torch_npu-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n")
        pkg = site / "torch_npu"
        pkg.mkdir()
        lines = [f"__version__ = '{version}'"]
        if git_version is not None:
            lines.append(f"git_version = {git_version!r}")
        lines.append("raise RuntimeError('torch_npu/version.py must be read, not imported')")
        (pkg / "version.py").write_text("\n".join(lines) + "\n")
        if record:
            files = ("torch_npu/version.py", f"{info.name}/METADATA", f"{info.name}/RECORD")
            (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
        self.monkeypatch.syspath_prepend(str(site))  # also clears importlib's caches
        if reset:
            torch_npu_capture.reset_cache()
        return site

    def absent(self) -> None:
        """No torch_npu distribution is found, whatever this box has."""
        self.monkeypatch.setattr(torch_npu_capture, "TORCH_NPU_DISTS", ("camp2p-no-such-torch-npu",))
        torch_npu_capture.reset_cache()
