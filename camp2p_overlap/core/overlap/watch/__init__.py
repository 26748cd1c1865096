"""Watching steps that do not finish: ``watchdog`` (the step watchdog's
thread and the replay watch) and ``stall_report`` (what an unfinished step
looks like, from its session's snapshot). May import what ``overlap`` may,
and the session's snapshot types, ``overlap.camp2p``, ``overlap.plan``
and ``overlap.streams``."""
