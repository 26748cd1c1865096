"""Command-line tools: the benchmark, the sweep and ``doctor``."""
