"""Whether a wrapped connector call may have anything to intercept: the
process's :data:`INTERCEPTS`, read as one attribute by every call of a
wrapped connector method before anything else runs.

It counts what needs the connector wrappers, over every thread and patch
engine of the process: a step's overlap session (held while it is set on
its thread, :meth:`OverlapRuntime.set_session`) and an active trace
recorder (:func:`trace.recording`). While the count is 0 the installed
wrapper calls the original at once (:mod:`core.method_wrapper`); while it
is above 0 every call goes to the wrapper, which then checks its own
thread's session and the recorder as before. A count too high only costs
that re-dispatch; holds and releases are paired so it is never too low.
"""

from __future__ import annotations

import threading


class InterceptSwitch:
    """A count of holders, read without a lock (``on``), changed under one."""

    def __init__(self) -> None:
        #: How many holders there are now; true while any is.
        self.on = 0
        self._lock = threading.Lock()

    def __bool__(self) -> bool:  # what a wrapt ``enabled`` that is not callable is tested with
        return self.on > 0

    def hold(self) -> None:
        with self._lock:
            self.on += 1

    def release(self) -> None:
        with self._lock:
            if self.on <= 0:
                raise RuntimeError("InterceptSwitch released more often than held")
            self.on -= 1


#: The process's switch.
INTERCEPTS = InterceptSwitch()
