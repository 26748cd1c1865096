"""Child of tests/hardware/test_gpu_script.py: the checkout at argv[1] alone,
as with ``PYTHONPATH=<checkout>`` and no install (the editable install's
finder dropped); prints where ``camp2p_overlap.patches`` is found and the
manifests that load."""

import importlib.util
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])

import camp2p_overlap  # noqa: E402, F401  (from the checkout put first above)

spec = importlib.util.find_spec("camp2p_overlap.patches")
print("SPEC", spec and spec.origin)
from camp2p_overlap.core.patching.manifest import load_manifest, load_manifests  # noqa: E402

print("LOADED", load_manifest().name, [m.name for m in load_manifests()])
