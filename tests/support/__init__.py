"""What the tests share, importable as ``support`` (``pythonpath = ["tests"]``
in pyproject.toml): child processes and their programs (``child``), the
stand-in stacks (``stacks``), log capture (``logs``), emulated steps
(``overlap``), patch-engine checks (``patching``), the host stand-in device
(``host_device_module``) and the hypothesis strategies (``strategies``, the only
one that imports hypothesis: the GPU box has none). ``tests/conftest.py``
holds only fixtures and hooks."""
