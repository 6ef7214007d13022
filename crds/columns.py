"""The RolloutJob table's columns, data only (no pydantic: `rolloutctl get` imports it on every call).

Used by the CRD (`crd.py`, kubectl's printer columns) and `rolloutctl get` (`controller/ctl/views.py`).
"""
from __future__ import annotations

from typing import Any

# The one vocabulary of a finished rollout (status.counts' keys, their words) and the one definition of the reward
# shown beside them: rolloutctl, kubectl, the web UI and the docs say exactly these (tests/test_vocabulary.py).
OUTCOMES = {"scored": "scored", "agentFailed": "agent-failed", "infraFailed": "infra-failed", "cancelled": "cancelled"}
REWARD_MEAN = "the mean reward of the scored and agent-failed rollouts (infra-failed and cancelled ones carry no reward)"

# The job table's columns, for `kubectl get` (here) and `rolloutctl get` (`controller/ctl/views.py`) alike: one
# vocabulary (scored / agent-failed / infra-failed / cancelled, as `StageCounts`); priority 1: `-o wide` only.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes", "description": "node daemons registered"},
    {"name": "Scored", "type": "integer", "jsonPath": ".status.counts.scored"},
    {"name": "Agent-Failed", "type": "integer", "jsonPath": ".status.counts.agentFailed"},
    {"name": "Infra-Failed", "type": "integer", "jsonPath": ".status.counts.infraFailed"},
    {"name": "Total", "type": "integer", "jsonPath": ".status.counts.total"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.rewardMean", "description": REWARD_MEAN},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Cancelled", "type": "integer", "jsonPath": ".status.counts.cancelled", "priority": 1},
    {"name": "Requested", "type": "integer", "jsonPath": ".spec.executor.nodes", "priority": 1,
     "description": "nodes asked for"},
    {"name": "Executor", "type": "string", "jsonPath": ".spec.executor.kind", "priority": 1},
    {"name": "Tasks", "type": "string", "jsonPath": ".spec.tasks.kind", "priority": 1},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
]
