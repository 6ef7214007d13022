"""`SlurmCluster`: the e2e test controller (tests/support/cluster.py) with the slurm executor, and Slurm's
view of its jobs. A module of its own (not conftest.py) so that test modules import it by a name no
other folder uses."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from support.cluster import Cluster, gated_job_doc, job_doc
from support.sim.minicluster import MiniSlurm


class SlurmCluster(Cluster):
    """The e2e controller process with the slurm executor enabled and SLURM_CONF in its environment."""

    executors = "local,slurm"

    def __init__(self, root: Path, slurm: MiniSlurm, env: dict[str, str] | None = None):
        super().__init__(root, slurm.env({**os.environ, **(env or {})}))
        self.slurm = slurm
        self.uids: set[str] = set()

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        obj = super().apply(doc)
        self.uids.add(obj["metadata"]["uid"])
        return obj

    def stop(self) -> None:
        super().stop()
        # never leave an allocation of this controller behind
        ids = [j["id"] for j in self.slurm.jobs() if _tag(j).get("uid") in self.uids]
        if ids:
            self.slurm.run("scancel", *ids, check=False)

    # ------------------------------------------------------------ Slurm views of a job

    def uid(self, name: str) -> str:
        return self.get(name)["metadata"]["uid"]

    def allocations(self, uid: str, *, all_states: bool = True) -> list[dict[str, str]]:
        """The Slurm jobs submitted for one RolloutJob (by the uid in their comment), oldest first."""
        rows = [j for j in self.slurm.jobs(all_states=all_states) if _tag(j).get("uid") == uid]
        return sorted(rows, key=lambda j: int(j["id"]))

    def live_allocations(self, uid: str) -> list[dict[str, str]]:
        return [j for j in self.allocations(uid) if j["state"] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")]

    def wait_no_allocations(self, uid: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.live_allocations(uid):
            if time.monotonic() > deadline:
                raise AssertionError(f"allocations left in squeue: {self.live_allocations(uid)}")
            time.sleep(0.2)

    def nodes(self, job: str) -> list[dict[str, Any]]:
        with self.db() as db:
            cols = ["id", "name", "slurm_job_id", "slurm_node_id", "state", "pid"]
            return [dict(zip(cols, r)) for r in db.execute(
                f"SELECT {', '.join(cols)} FROM nodes WHERE job = ?", (job,))]

    def events_of(self, name: str) -> list[dict[str, Any]]:
        r = self.api.get(f"/apis/rolloutd.io/v1alpha1/rolloutjobs/{name}/events")
        assert r.status_code == 200, r.text
        body = r.json()
        return body.get("items", body) if isinstance(body, dict) else body


def _tag(row: dict[str, str]) -> dict[str, str]:
    c = row.get("comment", "")
    if not c.startswith("rolloutd "):
        return {}
    return dict(kv.split("=", 1) for kv in c.split()[1:] if "=" in kv)


def slurm_job_doc(name: str, engine, *, nodes: int, slurm: dict[str, Any] | None = None, **kw) -> dict[str, Any]:
    doc = job_doc(name, engine, nodes=nodes, **kw)
    doc["spec"]["executor"] = {"kind": "slurm", "nodes": nodes, "slurm": slurm or {}}
    return doc


def slurm_gated_doc(name: str, engine, gate: Path, *, nodes: int, slurm: dict[str, Any] | None = None,
                    **kw) -> dict[str, Any]:
    """`slurm_job_doc` whose rollouts wait in INIT until `gate` exists (tests/support/cluster.py)."""
    doc = gated_job_doc(name, engine, gate, nodes=nodes, **kw)
    doc["spec"]["executor"] = {"kind": "slurm", "nodes": nodes, "slurm": slurm or {}}
    return doc
