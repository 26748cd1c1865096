"""Child of tests/observe/test_metrics.py: a worker process (configured by
the environment, ``PROMETHEUS_MULTIPROC_DIR`` included) that applies, runs
three engaged steps of a small emulated world, syncs the step counters as
the reporter thread does, and prints ``STATS=<json>`` (``stats()["steps"]``)."""

import json

import camp2p_overlap
from camp2p_overlap.core.observe import metrics
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.world import WorldSpec, build_world

report = camp2p_overlap.apply()
assert report.applied, str(report)
w = build_world(WorldSpec(layers=2, stage_ids=(0, 1), tokens=8, shape=MoEShape(hidden=32, ffn=64, experts=2, top_k=1)))
assert camp2p_overlap.status().engaged, str(camp2p_overlap.status())
for _ in range(3):
    w.run_step()
metrics.current_reporter().metrics.sync()  # what the reporter thread does every few seconds
print("STATS=" + json.dumps(camp2p_overlap.stats()["steps"]))
