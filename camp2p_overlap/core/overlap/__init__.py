"""The overlap runtime, in the order a step meets it: ``step`` (one wrapped
``_ffn_forward`` call as an object), ``decision`` (engage or not, with
which plan and layout), ``plan`` (the step's order, event keys, and the
layouts: where each op kind runs), ``session`` (the schedule, one path),
``routes`` (the connector's calls routed to a step), ``streams/`` (the
stream backend), ``adaptive`` engage, the ``camp2p`` adapter, ``graphs``
(decode graphs with both variants), ``watch/`` (the watchdog and its stall
report) and ``runtime`` (what one engine's steps share).
May import ``core.patching``, ``core.observe``, ``core.config``, ``core.keys`` and ``core.log``."""
