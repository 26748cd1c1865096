"""The overlap runtime, in the order a step meets it: ``step`` (one wrapped
``_ffn_forward`` call as an object), ``decision`` (engage or not), ``plan``
(the step's order, event keys and directions), ``session`` (the schedule
that drives the side streams), ``connector_routes``, ``streams/``,
``adaptive`` engage, the ``camp2p`` adapter, ``rollout`` modes, the
``watchdog`` and ``runtime`` (what one engine's steps share).
May import ``core.patching``, ``core.observe``, ``core.config``, ``core.keys`` and ``core.log``."""
