"""The patch lifecycle, generic over what is patched: the engine (apply,
refresh, unpatch), the installer and its registry, manifests and their
signature checks, the supported stacks, the step gate and the status report.
May import ``core.config`` and ``core.log`` only."""
