"""What the patch layer reports: the step counters behind ``stats()``, the
Prometheus metrics and the periodic summary, and the opt-in trace recorder.
May import ``core.config``, ``core.keys``, ``core.log`` and ``core.patching``."""
