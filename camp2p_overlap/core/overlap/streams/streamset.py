"""A runner's side streams (:class:`StreamSet`), made once outside any graph
capture and reused for every step; the runner's state owns and closes it."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from camp2p_overlap.core.keys import FFN_STREAM, side_stream_name
from camp2p_overlap.core.overlap.streams.backend import StreamBackend
from camp2p_overlap.core.overlap.streams.base import Stream

#: The name of the stream the patch layer captures its decode graph variant on.
VARIANT_CAPTURE_STREAM = "G"


class StreamSet:
    """A backend, one side stream per stage id (``K_s``: A2E and E2A in ``comm-side``), the FFN stream (``F``: the
    FFN compute in ``compute-side``) and, once a decode graph variant is to be captured, the stream that capture
    runs on."""

    def __init__(self, backend: StreamBackend, stage_ids: Sequence[int]) -> None:
        self.backend = backend
        self.streams: dict[int, Stream] = {s: backend.new_stream(side_stream_name(s)) for s in stage_ids}
        self.ffn: Stream = backend.new_stream(FFN_STREAM)
        self._capture_stream: Stream | None = None
        #: One step at a time per runner.
        self.lock = threading.Lock()

    def capture_stream(self) -> Stream:
        """The stream the variant capture runs on, made on first use (outside any
        capture: no stream may be made inside one)."""
        if self._capture_stream is None:
            self._capture_stream = self.backend.new_stream(VARIANT_CAPTURE_STREAM)
        return self._capture_stream

    def close(self) -> None:
        self.backend.close()
