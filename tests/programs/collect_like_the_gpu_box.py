"""Child of tests/hardware/test_gpu_script.py: ``pytest --collect-only -m gpu``
on the files of argv, with what the GPU box lacks (vLLM, grimp,
import-linter, hypothesis) made unimportable."""

import sys

BLOCKED = ("vllm", "grimp", "importlinter", "hypothesis")


class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU box)")
        return None


sys.meta_path.insert(0, Block())

import pytest  # noqa: E402  (after the block, as on the GPU box)

plugins_off = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", *plugins_off, *sys.argv[1:]]))
