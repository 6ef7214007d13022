"""Status that tells the truth, end to end: a real controller (local executor), real node daemons and bwrap
sandboxes, agent.kind oracle (no LLM, no engine) on the test plug-in `scripted-oracle` (tests/e2e/plugins).

- a task kind that cannot run the agent kind is a 422 at apply naming the fields;
- a job whose rollouts (mostly) fail as infra ends Failed (InfraFailures), never Complete;
- tokenizers: a missing directory or a model hub name is a 422 naming spec.llm.tokenizer;
- relative paths: refused by the API, resolved by `rolloutctl apply -f DIR/job.yaml` against DIR;
- one vocabulary: `rolloutctl get` prints kubectl's table (same columns, same values, the reward in both);
- daemons never outlive their controller: released on SIGTERM, given up after 20 × leaseSeconds + 60 s without it,
  and still adopted after a SIGKILL (a restart).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from support.cluster import P, REPO, Cluster, held_at_gate, plugin_env
from support.waiting import alive, wait_until

from rolloutd.client import JobEnded, RolloutClient
from rolloutd.crds.kit.paths import models_dir

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """One controller for this module's tests that apply jobs (each its own name) and read them back: a controller
    start is most of such a test's time. The tests that stop, kill or restart their controller take `own`."""
    c = Cluster(tmp_path_factory.mktemp("status-truth"), plugin_env()).start()
    yield c
    c.stop()


@pytest.fixture
def own(tmp_path) -> Iterator[Cluster]:
    """A controller of the test's own (the test stops, kills or restarts it)."""
    c = Cluster(tmp_path, plugin_env()).start()
    yield c
    c.stop()

ROWS = [{"id": i, "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]


def oracle_doc(name: str, source: str, *, samples: int = 2, attempts: int = 1, lease: float = 30) -> dict:
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": "scripted-oracle", "source": source},
            "samplesPerPrompt": samples,
            "agent": {"kind": "oracle"},
            "sandbox": {"runtime": "bwrap", "warm": 0},
            "executor": {"kind": "local", "nodes": 1},
            "pipeline": {"workersPerNode": {"init": 4, "run": 4, "eval": 4}, "maxAttempts": attempts,
                         "leaseSeconds": lease},
            "timeouts": {"initSeconds": 300},
        },
    }


def dataset(path: Path, scripts: list[str], gate: Path | None = None) -> str:
    extra = {"gate": str(gate)} if gate else {}
    path.write_text("".join(json.dumps({**row, "script": s, **extra}) + "\n" for row, s in zip(ROWS, scripts)))
    return str(path)


def final(cluster: Cluster, name: str) -> dict:
    return next(o for o in cluster.events(name, timeout=240)
                if o["status"].get("phase") in ("Succeeded", "Failed", "Cancelled"))


def ctl(cluster: Cluster, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLOUTD_SERVER": cluster.url, "ROLLOUTD_TOKEN": cluster.token,
           "ROLLOUTD_CONFIG": str(cluster.root / "no-config.yaml")}
    return subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)


# ---------------------------------------------------------------- 1. agent kinds, infra failures


def test_math_with_the_oracle_agent_is_refused_at_apply_naming_both_fields(cluster, tmp_path):
    doc = oracle_doc("math-oracle", str(REPO / "examples" / "math" / "train.jsonl"))
    doc["spec"]["tasks"]["kind"] = "math"
    r = cluster.api.put(f"{P}/rolloutjobs/math-oracle", json=doc)
    assert r.status_code == 422, r.text
    [cause] = r.json()["details"]["causes"]
    assert cause["field"] == "spec.agent.kind"
    assert "task kind 'math' (spec.tasks.kind) runs agent.kind loop, not 'oracle'" in cause["message"]
    assert cluster.api.get(f"{P}/rolloutjobs/math-oracle").status_code == 404


def test_a_job_whose_rollouts_all_fail_as_infra_ends_failed_and_is_never_complete(cluster, tmp_path):
    cluster.apply(oracle_doc("all-infra", dataset(tmp_path / "d.jsonl", ["infra"] * 4), attempts=2))
    end = final(cluster, "all-infra")
    st = end["status"]
    assert st["phase"] == "Failed", st
    assert st["counts"]["infraFailed"] == 8 and st["counts"]["scored"] == 0 and st["counts"]["agentFailed"] == 0
    conditions = {c["type"]: c for c in st["conditions"]}
    assert conditions["Complete"]["status"] == "False"  # what kubectl wait --for=condition=Complete reads
    assert conditions["Failed"]["status"] == "True" and conditions["Failed"]["reason"] == "InfraFailures"
    assert "8 of 8 rollouts failed for infrastructure reasons" in conditions["Failed"]["message"]
    assert "scripted infrastructure failure" in conditions["Failed"]["message"]
    with RolloutClient(cluster.url, token=cluster.token) as client, pytest.raises(JobEnded):
        client.wait("all-infra", "Complete", timeout=30)


def test_a_few_infra_failures_under_the_ratio_still_succeed_and_are_counted(cluster, tmp_path):
    cluster.apply(oracle_doc("few-infra", dataset(tmp_path / "d.jsonl", ["ok", "ok", "ok", "infra"])))
    st = final(cluster, "few-infra")["status"]
    assert st["phase"] == "Succeeded", st
    assert (st["counts"]["scored"], st["counts"]["agentFailed"], st["counts"]["infraFailed"]) == (6, 0, 2)
    assert st["rewardMean"] == 1.0
    assert st["message"] == "6 scored, 0 agent-failed, 2 infra-failed, 0 cancelled"
    # maxInfraFailureRatio is the user's: 2 of 8 over 0.2 fails the same job
    doc = oracle_doc("few-infra-strict", dataset(tmp_path / "e.jsonl", ["ok", "ok", "ok", "infra"]))
    doc["spec"]["pipeline"]["maxInfraFailureRatio"] = 0.2
    cluster.apply(doc)
    assert final(cluster, "few-infra-strict")["status"]["phase"] == "Failed"


# ---------------------------------------------------------------- 2 and 3. tokenizers and relative paths


@pytest.mark.parametrize("tokenizer, says", [
    (str(models_dir() / "no-such-model"), "is not a directory on this machine"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "is not a tokenizer directory: no such directory beside the job file"),
])
def test_a_tokenizer_that_cannot_load_offline_is_refused_at_apply(cluster, tmp_path, tokenizer, says):
    doc = oracle_doc("tok", dataset(tmp_path / "d.jsonl", ["ok"] * 4))
    doc["spec"]["agent"] = {"kind": "loop"}
    doc["spec"]["tasks"]["kind"] = "math"
    doc["spec"]["llm"] = {"tokenizer": tokenizer, "backends": [{"url": "http://127.0.0.1:9"}]}
    r = cluster.api.put(f"{P}/rolloutjobs/tok", json=doc)
    assert r.status_code == 422, r.text
    causes = r.json()["details"]["causes"]
    assert [c["field"] for c in causes] == ["spec.llm.tokenizer"] and says in causes[0]["message"], causes


def test_the_api_refuses_a_relative_source_and_rolloutctl_resolves_it_against_the_file(cluster, tmp_path):
    job_dir = tmp_path / "project"
    job_dir.mkdir()
    dataset(job_dir / "rows.jsonl", ["ok"] * 4)
    doc = oracle_doc("rel", "rows.jsonl")
    r = cluster.api.put(f"{P}/rolloutjobs/rel", json=doc)
    assert r.status_code == 422 and r.json()["details"]["causes"][0]["field"] == "spec.tasks.source", r.text
    (job_dir / "job.yaml").write_text(json.dumps(doc))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = ctl(cluster, "apply", "-f", "../project/job.yaml", cwd=elsewhere)
    assert out.returncode == 0, out.stderr
    assert cluster.get("rel")["spec"]["tasks"]["source"] == str(job_dir / "rows.jsonl")
    assert final(cluster, "rel")["status"]["counts"]["scored"] == 8


# ---------------------------------------------------------------- 4. one vocabulary, one table


def test_rolloutctl_get_prints_the_table_kubectl_prints(cluster, tmp_path):
    cluster.apply(oracle_doc("table", dataset(tmp_path / "d.jsonl", ["ok", "ok", "ok", "infra"])))
    final(cluster, "table")
    kube = cluster.api.get(f"{P}/rolloutjobs/table", headers={
        "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}).json()
    names = [c["name"].upper() for c in kube["columnDefinitions"] if c["priority"] == 0]
    cells = [str(c) for c, d in zip(kube["rows"][0]["cells"], kube["columnDefinitions"]) if d["priority"] == 0]
    header, row = ctl(cluster, "get", "rj", "table").stdout.splitlines()[:2]
    assert header.split() == names == ["NAME", "PHASE", "NODES", "SCORED", "AGENT-FAILED", "INFRA-FAILED",
                                       "TOTAL", "REWARD", "AGE"]
    assert row.split()[:-1] == ["table", "Succeeded", "0", "6", "0", "2", "8", "1"] == cells[:-2] + ["1"]
    assert cells[-2] == "1.0"  # the reward in both
    described = ctl(cluster, "describe", "rj", "table").stdout
    assert "Rollouts:    queued 0, init 0, run 0, eval 0, scored 6, agent-failed 0, infra-failed 2, cancelled 0" \
        in described and "Reward:      1.0" in described


# ---------------------------------------------------------------- 5. daemons never outlive their controller


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out.update(kids)
            todo.extend(kids)
    return out


def _held_job(cluster: Cluster, tmp_path: Path, name: str, lease: float = 30) -> tuple[Path, list[int]]:
    gate = tmp_path / "gate"
    cluster.apply(oracle_doc(name, dataset(tmp_path / "d.jsonl", ["ok"] * 4, gate), lease=lease))
    wait_until(lambda: held_at_gate(cluster, name) >= 1, 120, "a rollout held at INIT's gate", every=0.1)
    return gate, cluster.daemon_pids()


def test_a_controller_stopped_with_sigterm_releases_its_local_daemons(own, tmp_path):
    cluster = own
    _, pids = _held_job(cluster, tmp_path, "released")
    assert pids and all(alive(p) for p in pids)
    os.killpg(cluster.proc.pid, signal.SIGTERM)
    cluster.proc.wait(30)
    # the daemons' pending policy watches were answered (503: watch again), not cut at the server's graceful timeout
    assert "Exception in ASGI application" not in (tmp_path / "controller.log").read_text()
    # ROLLOUTD_DRAIN_SECONDS is 10 in the test cluster: the held rollout is given that long, then handed back
    wait_until(lambda: not any(alive(p) for p in pids), 90, "the daemons to exit after the controller's SIGTERM",
               every=0.2)


def test_a_daemon_that_cannot_reach_its_controller_for_20_leases_exits_and_ends_its_sandboxes(tmp_path):
    # the operator's ROLLOUTD_CONTROLLER_START_SECONDS (default 60) shortened: the daemons inherit it
    cluster = Cluster(tmp_path, {**plugin_env(), "ROLLOUTD_CONTROLLER_START_SECONDS": "5"}).start()
    try:
        _gives_up(cluster, tmp_path)
    finally:
        cluster.stop()


def _gives_up(cluster, tmp_path) -> None:
    _, pids = _held_job(cluster, tmp_path, "orphan", lease=2)
    [pid] = pids
    sandbox_procs = _descendants(pid)
    assert sandbox_procs, "the held rollout's sandbox runs under the daemon"
    cluster.kill()  # SIGKILL: the daemons live on (a restart would adopt them) ...
    assert alive(pid)
    # ... but not for ever: 20 × leaseSeconds (40 s) + 5 s for a controller's start without an answer, then they leave
    wait_until(lambda: not alive(pid), 180, "the daemon to give up on its controller", every=0.2)
    assert not [p for p in sandbox_procs if alive(p)], "its sandboxes ended with it"
    log = next((cluster.data_dir / "logs").glob("orphan-node0.log")).read_text()
    assert "the controller has not answered for" in log and "20 × spec.pipeline.leaseSeconds + 5 s" in log


def test_a_killed_controller_restarted_adopts_its_daemons_and_the_job_completes(own, tmp_path):
    cluster = own
    gate, pids = _held_job(cluster, tmp_path, "adopted")
    cluster.kill()
    cluster.start()
    assert cluster.daemon_pids() == pids and all(alive(p) for p in pids)
    gate.touch()
    assert final(cluster, "adopted")["status"]["counts"]["scored"] == 8
    assert cluster.daemon_pids() == [] or all(p in pids for p in cluster.daemon_pids())


# ---------------------------------------------------------------- 4. every backend down


def test_a_job_whose_every_backend_is_down_says_why(cluster, tmp_path):
    from support.controller_process import free_port

    dead = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    doc = oracle_doc("no-backend", dataset(tmp_path / "d.jsonl", ["ok"] * 4, gate=tmp_path / "gate"))
    doc["spec"]["llm"] = {"backends": [{"url": dead}]}
    cluster.apply(doc)
    with RolloutClient(cluster.url, token=cluster.token) as client:
        job = client.wait("no-backend", "BackendsReady=False", timeout=120)
        cond = next(c for c in job["status"]["conditions"] if c["type"] == "BackendsReady")
        assert cond["reason"] == "BackendsUnavailable" and dead in cond["message"], cond
        assert job["status"]["message"].startswith("every LLM backend is down") and dead in job["status"]["message"]
        # the event is posted after the status write that set the condition: wait for it, not for the status
        wait_until(lambda: [e for e in client.events("no-backend") if e["reason"] == "BackendsUnavailable"], 30,
                   "the BackendsUnavailable event")
    wide = ctl(cluster, "get", "rolloutjobs", "no-backend", "-o", "wide").stdout
    assert "MESSAGE" in wide.splitlines()[0] and "every LLM backend is down" in wide, wide
    (tmp_path / "gate").touch()


# ---------------------------------------------------------------- 5. results outlive a delete


def test_results_outlive_a_delete_until_purged_and_can_be_exported_first(cluster, tmp_path):
    cluster.apply(oracle_doc("kept", dataset(tmp_path / "d.jsonl", ["ok"] * 4)))
    assert final(cluster, "kept")["status"]["phase"] == "Succeeded"
    every = json.loads(ctl(cluster, "trajectories", "kept", "-o", "json").stdout)          # one JSON array
    assert len(every) == 8
    one = json.loads(ctl(cluster, "trajectories", "kept", "-o", "json", "--prompt", "1").stdout)
    assert [t["prompt"] for t in one] == [1, 1]
    assert ctl(cluster, "trajectories", "kept", "-o", "json", "--outcome", "infra-failed").stdout.strip() == "[]"
    table = ctl(cluster, "trajectories", "kept", "--outcome", "scored").stdout.splitlines()
    assert "TURNS" in table[0].split() and len(table) == 9
    out = ctl(cluster, "delete", "rj", "kept", "--wait", "--export", str(tmp_path / "kept.jsonl"))
    assert out.returncode == 0, out.stderr
    exported = [json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert len(exported) == 8 and "8 trajectories" in out.stdout
    assert cluster.api.get(f"{P}/rolloutjobs/kept").status_code == 404          # the job is gone …
    kept = ctl(cluster, "trajectories", "kept", "-o", "jsonl")                   # … its results are not
    assert [json.loads(line)["seq"] for line in kept.stdout.splitlines()] == [t["seq"] for t in exported]
    with RolloutClient(cluster.url, token=cluster.token) as client:              # a follow ends with what is kept
        assert len(list(client.trajectories("kept", follow=True, timeout=30))) == 8
    purged = ctl(cluster, "delete", "rj", "kept", "--purge")
    assert purged.returncode == 0 and "purged" in purged.stdout, purged.stderr
    assert ctl(cluster, "trajectories", "kept").returncode == 1                  # NotFound now


def test_a_deleted_jobs_results_are_purged_once_the_retention_ends(tmp_path):
    c = Cluster(tmp_path, env={**plugin_env(), "ROLLOUTD_RESULT_RETENTION_SECONDS": "1"}).start()
    try:
        c.apply(oracle_doc("brief", dataset(tmp_path / "d.jsonl", ["ok"] * 4)))
        assert final(c, "brief")["status"]["phase"] == "Succeeded"
        assert c.api.get(f"{P}/rolloutjobs/brief/trajectories").text.count("\n") == 8   # kept while the job lives
        c.api.delete(f"{P}/rolloutjobs/brief")
        wait_until(lambda: c.api.get(f"{P}/rolloutjobs/brief/trajectories").status_code == 404, timeout=60, every=0.2)
    finally:
        c.stop()
