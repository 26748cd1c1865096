"""Child of tests/package/test_layers.py: imports the package and prints
the sorted list of loaded modules whose names start with one of argv."""

import sys

import camp2p_overlap  # noqa: F401  (the import is what is measured)

print(sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[1:]))))
