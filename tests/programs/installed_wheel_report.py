"""Child of tests/package/test_install.py, run by the interpreter of a fresh
venv that has only the built wheel installed: imports the package, loads
the manifest and both stacks' stand-ins, and prints ``OUT <json>`` with what
was imported and where every file came from."""

import importlib.metadata
import json
import sys
from importlib import resources

import camp2p_overlap

imported = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "afd_plugin", "torch_npu"))

from camp2p_overlap.core.patching.manifest import available_stacks, load_manifest  # noqa: E402
from camp2p_overlap.emulation import standins  # noqa: E402

man = load_manifest()
dist = importlib.metadata.distribution("camp2p-overlap")
standins.install()
runner_mod, conn_mod, _ = standins.import_standins()
standins.uninstall()
standins.install(stack="vllm-0.26.0")
main_runner, _, _ = standins.import_standins()
print(
    "OUT "
    + json.dumps(
        {
            "stacks": available_stacks(),
            "main_runner_file": main_runner.__file__,
            "imported": imported,
            "package": camp2p_overlap.__file__,
            "manifest_dir": str(resources.files("camp2p_overlap.patches")),
            "stack": man.name,
            "targets": len(man.targets()),
            "dist_files": [str(f) for f in (dist.files or [])],
            "entry_points": [(e.group, e.name, e.value) for e in dist.entry_points],
            "prefix": sys.prefix,
            "standin_classes": [runner_mod.AFDNPUFFNModelRunner.__name__, conn_mod.CAMP2pAFDConnector.__name__],
            "standin_file": runner_mod.__file__,
        }
    )
)
