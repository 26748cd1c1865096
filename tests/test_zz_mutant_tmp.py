import sys; sys.path.insert(0, "/work/main/tests")
from test_patch_abuse import *  # noqa
from camp2p_overlap.patcher import ENGINE as E

def test_mutant(make_world, monkeypatch):
    def step_enter():
        with E._lock:
            return E.applied and not E.unpatching
    monkeypatch.setattr(E, "step_enter", step_enter)
    monkeypatch.setattr(E, "step_exit", lambda: None)
    test_apply_unpatch_storm_while_steps_run(make_world)
