"""The node protocol over HTTP against a real app and scheduler (math-demo, 4 prompts × 2 samples, one node):
what the piggy-back and features tests share."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

from fastapi.testclient import TestClient

from rolloutd.controller.api import create_app
from rolloutd.controller.store import Store
from rolloutd.controller.root import assemble
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.rolloutjob import RolloutJob
from support.example_job import example_doc

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math-demo.yaml"
NODES = "/apis/rolloutd.io/v1alpha1/nodes"
JOIN = {"Authorization": "Bearer admin"}  # the admin acts as any node (tests/tenancy: node tokens)


@contextlib.contextmanager
def node_api(tmp_path: Path, clock=None, lease_seconds: float | None = None) -> Iterator[tuple[TestClient, Scheduler]]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    doc = example_doc()
    doc["spec"]["tasks"] = {"kind": "math", "source": str(data)}
    doc["spec"]["samplesPerPrompt"] = 2
    doc["spec"]["executor"]["nodes"] = 1
    if lease_seconds is not None:
        doc["spec"]["pipeline"]["leaseSeconds"] = lease_seconds
    store = Store(tmp_path / "db.sqlite")
    store.apply(RolloutJob.model_validate(doc))
    root = assemble(store, "admin", work={} if clock is None else {"clock": clock})
    scheduler = root.scheduler
    scheduler.work.expansions.expand(store.get("math-demo"))
    with TestClient(create_app(root)) as client:
        yield client, scheduler


def call(api: TestClient, path: str, body) -> dict:
    r = api.post(f"{NODES}/{path}", json=body, headers=JOIN)
    assert r.status_code == 200, r.text
    return r.json()


def result(attempt_id: str, reward: float = 1.0) -> dict:
    return {"attemptId": attempt_id, "trajectory": {"job": "x", "prompt": 0, "sample": 0, "reward": reward}}
