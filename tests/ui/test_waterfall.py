"""The trajectory page's waterfall (`controller/ui/waterfall.py`) from a trajectory's timings and turns: the queue,
the node's wait for a slot, one bar per stage exactly as long as `timings` says, a wait wherever a stage began after
the one before ended, and per turn its model call then its tools; the split adds up to the stages."""
from __future__ import annotations

import pytest

from rolloutd.controller.ui.waterfall import waterfall


def test_stages_waits_and_turns_on_one_time_axis():
    t = {"timings": {"queue": 0.5, "init": 1.0, "run": 4.0, "eval": 0.25,
                     "stamps": {"init": 101.0, "run": 102.5, "eval": 106.5, "end": 106.75}},
         "metrics": {"node_wait_init_seconds": 0.5},
         "turns": [{"started": 102.6, "modelSeconds": 1.0, "toolSeconds": 2.0},
                   {"started": 105.7, "modelSeconds": 0.5}]}
    w = waterfall(t)
    got = [(b["kind"], b["label"], b["start"], b["seconds"]) for b in w["bars"]]
    assert got == [("queue", "queue", 0.0, 0.5), ("wait", "wait for an init slot", 0.5, 0.5),
                   ("stage", "init", 1.0, 1.0), ("wait", "wait for a run slot", 2.0, 0.5),
                   ("stage", "run", 2.5, 4.0), ("stage", "eval", 6.5, 0.25),
                   ("model", "turn 1: model", pytest.approx(2.6), 1.0), ("tool", "turn 1: tools", pytest.approx(3.6), 2.0),
                   ("model", "turn 2: model", pytest.approx(5.7), 0.5)]
    assert w["total"] == 6.75
    assert w["split"] == {"queue": 0.5, "init": 1.0, "model": 1.5, "tool": 2.0, "otherRun": 0.5, "eval": 0.25}


def test_a_harness_segments_turns_and_a_rollout_that_never_started():
    t = {"timings": {"init": 1.0, "run": 2.0, "stamps": {"init": 10.0, "run": 11.0, "end": 13.0}},
         "segments": [{"turns": [{"started": 11.0, "modelSeconds": 0.5}]}, {"turns": [{"started": 12.0,
                                                                                       "modelSeconds": 0.25}]}]}
    assert [b["label"] for b in waterfall(t)["bars"] if b["kind"] == "model"] == ["turn 1: model", "turn 2: model"]
    assert waterfall({"timings": {"queue": 3.0}}) is None
    assert waterfall({}) is None



def _plain() -> dict:
    return {"timings": {"queue": 0.5, "init": 1.0, "run": 4.0, "stamps": {"init": 101.0, "run": 102.5, "end": 107.0}},
            "turns": [{"started": 102.6, "modelSeconds": 1.0}, {"started": 102.7, "modelSeconds": 1.0}]}


@pytest.mark.parametrize("where", ["timings", "turns", "metrics"])
def test_times_no_sum_can_take_show_no_waterfall(where):
    """Two stages of 1e308 s made the total infinite, which the page's JSON cannot hold: the page was a 500."""
    t = _plain()
    if where == "timings":
        t["timings"].update(queue=1e308, run=1e308)
    elif where == "turns":
        for turn in t["turns"]:
            turn["modelSeconds"] = 1e308
    else:
        t["metrics"] = {"node_wait_init_seconds": 10**400}
    assert waterfall(t) is None
    t = _plain()
    t["timings"]["queue"] = 1e15  # the largest a sum takes
    assert waterfall(t)["split"]["queue"] == 1e15
