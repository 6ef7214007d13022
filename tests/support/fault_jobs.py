"""Jobs for the fault tests (tests/faults): gated oracle rollouts (the `scripted-oracle` plug-in of tests/e2e/plugins:
no engine) on one node with short leases, and the check that every rollout was scored exactly once."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.cluster import REPO, Cluster

LEASE_SECONDS = 2.0


def gated_oracle_job(name: str, gate: Path, *, rollouts: int = 8, max_attempts: int = 1) -> dict[str, Any]:
    """`rollouts` oracle rollouts (right answers: reward 1) that wait in INIT until the file `gate` exists; one
    node, `LEASE_SECONDS` leases, `max_attempts` 1: an attempt the controller gives up on is an infra failure."""
    rows = [json.loads(line) for line in (REPO / "examples" / "math" / "train.jsonl").read_text().splitlines()
            if line.strip()][:rollouts]
    source = gate.parent / f"{name}.jsonl"
    source.write_text("".join(json.dumps({**row, "gate": str(gate)}) + "\n" for row in rows))
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name}, "spec": {
        "tasks": {"kind": "scripted-oracle", "source": str(source), "limit": rollouts}, "samplesPerPrompt": 1,
        "agent": {"kind": "oracle", "maxTurns": 1},
        "sandbox": {"runtime": "bwrap", "image": "host", "network": False},
        "executor": {"kind": "local", "nodes": 1},
        "pipeline": {"workersPerNode": {"init": rollouts, "run": rollouts, "eval": rollouts},
                     "leaseSeconds": LEASE_SECONDS, "maxAttempts": max_attempts},
        "timeouts": {"initSeconds": 600, "runSeconds": 60, "evalSeconds": 60}}}


def scored_once(cluster: Cluster, name: str, n: int) -> list[dict[str, Any]]:
    """The job's trajectories: exactly one per rollout, each scored (no infra failure)."""
    got = cluster.trajectories(name)
    assert len(got) == n, [t.get("failure") for t in got]
    failures = [t["failure"] for t in got if t["failure"]["kind"] != "none"]
    assert not failures, failures
    assert all(t["reward"] == 1.0 for t in got)
    assert len({(t["prompt"], t["sample"]) for t in got}) == n
    return got
