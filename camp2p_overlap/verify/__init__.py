"""Verification that tools and tests use, never a worker's step: the edge
checker over step traces, the peer-cycle check, and device timelines read
from profiler traces. May import ``core``; ``core`` never imports it."""
