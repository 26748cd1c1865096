"""Child of tests/package/test_architecture.py and tests/emulation/test_device_module_registry.py:
imports the package (and, with ``--apply`` first, calls ``apply()``), then
prints the sorted list of loaded modules whose names start with one of the
other arguments."""

import sys

import camp2p_overlap

prefixes = sys.argv[1:]
if prefixes[:1] == ["--apply"]:
    prefixes = prefixes[1:]
    camp2p_overlap.apply()

print(sorted(m for m in sys.modules if m.startswith(tuple(prefixes))))
