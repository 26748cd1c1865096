"""The overlap runtime: one wrapped ``_ffn_forward`` call as a step object,
its decision and plan, the session that drives the schedule, the side
streams, adaptive engage, the CAMP2P adapter, rollout modes and the watchdog.
May import ``core.patching``, ``core.observe``, ``core.config``, ``core.keys`` and ``core.log``."""
