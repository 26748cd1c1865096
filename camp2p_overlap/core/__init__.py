"""The patch layer a vLLM worker runs: ``patching/`` (the lifecycle),
``overlap/`` (the step and its schedule) and ``observe/`` (what the patch layer
counts and records), over ``config``, ``keys`` and ``log``; ``patch_layer`` builds
the process-wide patch layer, ``plugin`` is vLLM's entry point. Imports nothing
from ``tools``, ``emulation``, ``verify`` or ``testing``."""
