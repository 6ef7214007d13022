"""A store restored from a backup never hands out a trajectory seq again: every seq issued after the restore is above
every one issued before it, so a trainer resuming a stream from a cursor saved after the backup skips nothing (before:
SQLite's rowid went on from the backup's largest, reusing the numbers of the trajectories the restore dropped).
Real controller, real node daemons (the `bench-noop` task kind: no engine, no sandbox)."""
from __future__ import annotations

import json
import os
import sqlite3

from support.controller_process import ControllerProcess
from support.waiting import wait_until
from support.sim.noop import NOOP, PLUGINS

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}


def _run(api, tmp_path, name: str, n: int = 4) -> list[int]:
    rows = tmp_path / f"{name}.jsonl"
    rows.write_text("".join(json.dumps({"id": f"{name}{i}"}) + "\n" for i in range(n)))
    job = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name}, "spec": {
        "tasks": {"kind": NOOP, "source": str(rows), "limit": n}, "samplesPerPrompt": 1,
        "agent": {"kind": "oracle", "maxTurns": 1}, "executor": {"kind": "local", "nodes": 1}}}
    assert api.post(P, json=job).status_code == 201
    wait_until(lambda: api.get(f"{P}/{name}").json()["status"].get("phase") in ("Succeeded", "Failed"), 120,
               f"job {name} to end", every=0.2)
    assert api.get(f"{P}/{name}").json()["status"]["phase"] == "Succeeded"
    return _seqs(api, name)


def _seqs(api, name: str) -> list[int]:
    r = api.get(f"{P}/{name}/trajectories", params={"limit": 100})
    return [json.loads(line)["seq"] for line in r.text.splitlines() if line.strip()]


def test_seqs_after_a_restore_from_backup_go_on_above_every_seq_handed_out(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    c = ControllerProcess(data, executors="local", env=ENV)
    c.start()
    try:
        with c.client() as api:
            kept = _run(api, tmp_path, "kept")
            backup = tmp_path / "backup.db"
            with sqlite3.connect(data / "rolloutd.db") as live, sqlite3.connect(backup) as copy:
                live.backup(copy)
            dropped = _run(api, tmp_path, "dropped")  # delivered after the backup: the restore loses them
            assert min(dropped) > max(kept)
    finally:
        c.stop()
    for suffix in ("", "-wal", "-shm"):
        (data / f"rolloutd.db{suffix}").unlink(missing_ok=True)
    os.replace(backup, data / "rolloutd.db")
    c.start()
    try:
        with c.client() as api:
            assert api.get(f"{P}/dropped").status_code == 404
            again = _run(api, tmp_path, "again")
            assert min(again) > max(dropped), (kept, dropped, again)
            assert _seqs(api, "kept") == kept  # what the backup held reads back as it was
    finally:
        c.stop()
