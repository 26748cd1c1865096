"""Adaptive engage: ``engage`` (per-bucket overlap-or-serial decisions from
measured step times) and ``timings`` (a runner's step and replay timings,
read once their device events complete). May import what ``overlap`` may,
and ``overlap.capture_guard`` and ``overlap.streams``."""
