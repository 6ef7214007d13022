"""The trainer API's answer models (crds/trainer_api.py), as the routes use them (FastAPI checks the answer against
the model, then writes it by alias, unset fields left out): an answer goes out as it came, key for key, and one that
drifted from its model (a field missing, one more, a wrong type) is refused naming the field. The schemathesis run
(tests/controller/http/test_fuzz.py) holds the real controller's answers to the same models."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from rolloutd.crds.trainer_api import Batch, BackendList, JobPolicy, PolicyAnnounce


def answer(model, out: dict) -> dict:
    """What a route sends for `out` (`controller/http/trainer.py`'s `typed`)."""
    return model.model_validate(out).model_dump(mode="json", by_alias=True, exclude_unset=True)


BACKENDS = {"items": [{"url": "http://127.0.0.1:8000", "healthy": False, "reason": "down", "inflight": 3,
                       "pinnedToJob": 2, "admissionCap": 64}]}
ANNOUNCE = {"version": 2, "mode": "keep", "pausedSeconds": 0.41, "enginesPausedSeconds": 0.3,
            "steps": {"hold": 0.01, "held": {"node-1": 0.2}}, "drained": True,
            "backends": [{"url": "http://127.0.0.1:8000", "reloaded": True, "error": None, "reloadSeconds": 0.2}]}
BATCH = {"batch": 1, "state": "complete", "target": 2, "counted": 2, "prompts": None, "openedGroups": 3,
         "cancelledRollouts": 1, "neverStarted": 0, "savedTokensEstimate": 900, "secondsToFill": 4.5,
         "policyVersions": ["1"], "groups": [{"group": 7, "prompt": 0, "state": "counted", "rewards": [0.0, 1.0],
                                              "samples": [{"seq": 1, "tokenIds": [1, 2]}]}]}


@pytest.mark.parametrize("model, out", [(BackendList, BACKENDS), (PolicyAnnounce, ANNOUNCE), (Batch, BATCH),
                                        (JobPolicy, {"version": None, "history": [], "paused": False,
                                                     "staleness": {}})])
def test_an_answer_goes_out_key_for_key(model, out):
    assert answer(model, out) == out


@pytest.mark.parametrize("drift, field", [
    (lambda b: b["items"][0].pop("pinnedToJob"), "pinnedToJob"),
    (lambda b: b["items"][0].update(weights="x"), "weights"),
    (lambda b: b["items"][0].update(inflight="many"), "inflight"),
])
def test_an_answer_that_drifted_is_refused_naming_the_field(drift, field):
    out = {"items": [dict(BACKENDS["items"][0])]}
    drift(out)
    with pytest.raises(ValidationError, match=field):
        answer(BackendList, out)
