"""The tiny benchmark world the bench tests share: as command-line flags
(``TINY``) and as ``BenchParams`` fields (``TINY_PARAMS``), the same world."""

TINY = [
    "--layers", "2", "--tokens", "16", "--hidden", "64", "--ffn", "128", "--experts", "4", "--top-k", "2",
    "--link-latency-us", "100", "--link-gbps", "8", "--attn-us", "100",
    "--steps", "2", "--warmup", "1", "--reps", "2", "--no-progress",
]  # fmt: skip
TINY_PARAMS = {
    "layers": 2, "tokens": 16, "hidden": 64, "ffn": 128, "experts": 4, "top_k": 2,
    "link_latency_us": 100.0, "link_gbps": 8.0, "attn_us": 100.0, "steps": 2, "warmup": 1, "reps": 2,
}  # fmt: skip
