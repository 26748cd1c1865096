"""Child of tests/observe/test_metrics.py: a worker process (configured by
the environment, ``PROMETHEUS_MULTIPROC_DIR`` included) that applies, runs
three engaged steps of a small emulated world, syncs the step counters as
the reporter thread does, and prints ``STATS=<json>`` (``stats()["steps"]``).

With the argument ``fork`` it also counts one graph replay, then forks
after syncing (as a worker that forks a helper would): the child prints
``CHILD=<json>`` (what it inherited of ``stats()``, then its ``steps``
after one step of its own world, synced into the directory) and the parent
``CHILD_EXIT=<code>`` before its own ``STATS=``."""

import json
import os
import sys

import camp2p_overlap
from camp2p_overlap.core.observe import metrics
from camp2p_overlap.core.patch_layer import PATCH_LAYER
from camp2p_overlap.emulation.moe import MoEShape
from camp2p_overlap.emulation.world import WorldSpec, build_world


def small_world():
    return build_world(
        WorldSpec(layers=2, stage_ids=(0, 1), tokens=8, shape=MoEShape(hidden=32, ffn=64, experts=2, top_k=1))
    )


report = camp2p_overlap.apply()
assert report.applied, str(report)
w = small_world()
assert camp2p_overlap.status().engaged, str(camp2p_overlap.status())
for _ in range(3):
    w.run_step()
fork = "fork" in sys.argv[1:]
if fork:
    PATCH_LAYER.runtime.counters.graph_replay("overlap")
metrics.current_reporter().metrics.sync()  # what the reporter thread does every few seconds
if fork:
    pid = os.fork()
    if pid == 0:  # the child: its own world (the parent's stream and peer threads are not here)
        code = 3
        try:
            stats = camp2p_overlap.stats()
            inherited = {k: stats[k] for k in ("steps", "graph_replays")}
            small_world().run_step()
            metrics.current_reporter().metrics.sync()
            print("CHILD=" + json.dumps({"inherited": inherited, "steps": camp2p_overlap.stats()["steps"]}), flush=True)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported to the parent's output
            print(f"CHILD FAILED: {exc!r}", flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(f"CHILD_EXIT={os.waitstatus_to_exitcode(status)}")
print("STATS=" + json.dumps(camp2p_overlap.stats()["steps"]))
