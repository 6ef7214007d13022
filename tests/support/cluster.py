"""Helpers for the end-to-end tests: a controller process with the local executor, and job specs."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from rolloutd.sandbox.host.footprint import sweep_stale
from support.ports import free_port
from support.waiting import alive, wait_until

REPO = Path(__file__).resolve().parents[2]
P = "/apis/rolloutd.io/v1alpha1"
PLUGINS = Path(__file__).resolve().parents[1] / "e2e" / "plugins"  # test-only task plug-ins (scripted, gated)


def plugin_env() -> dict[str, str]:
    """Environment for a controller (and so its daemons) that can load the test plug-ins."""
    return {"PYTHONPATH": f"{PLUGINS}:{os.environ.get('PYTHONPATH', '')}"}


class Cluster:
    """A `rolloutd controller --executors local` process and helpers to drive jobs through its API."""

    executors = "local"

    def __init__(self, root: Path, env: dict[str, str] | None = None):
        self.root = root
        self.data_dir = root / "data"
        self.port = free_port()
        self.env = {**os.environ, "ROLLOUTD_DRAIN_SECONDS": "10", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(self.data_dir),
                "--port", str(self.port), "--executors", self.executors, "--log-level", "info"]

    def start(self) -> "Cluster":
        return self.launch().ready()

    def launch(self) -> "Cluster":
        """Start the controller's process, not waiting for it to answer (`ready`)."""
        log = open(self.root / "controller.log", "ab")
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=self.env, start_new_session=True)
        return self

    def ready(self, timeout: float = 60) -> "Cluster":
        """Wait until the launched controller answers /healthz."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited: {(self.root / 'controller.log').read_text()[-3000:]}")
            try:
                answered = httpx.get(self.url + "/healthz", timeout=1).status_code == 200
            except httpx.TransportError:
                answered = False
            # its token is written before it listens: a /healthz without it is another process on the port
            if answered and (self.data_dir / "token").exists():
                self.api = httpx.Client(base_url=self.url, timeout=60,
                                        headers={"Authorization": f"Bearer {self.token}"})
                return self
            time.sleep(0.05)
        raise RuntimeError("controller did not start")

    @property
    def token(self) -> str:
        return (self.data_dir / "token").read_text().strip()

    def kill(self) -> None:
        """SIGKILL the controller only (its node daemons are in their own sessions and live on)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        killed = []
        for pid in self.daemon_pids():  # never leave daemons behind after a test
            try:
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        self.sweep(killed)

    def sweep(self, killed: list[int]) -> None:
        """What a SIGKILLed daemon leaves — its sandboxes' workspace mounts and directories (their processes die
        with it) — removed as the node's next daemon would (`sweep_stale`): a per-test sandbox dir has no next one."""
        wait_until(lambda: not any(alive(p) for p in killed), 30, "the killed daemons to be gone", every=0.05)
        if self.env.get("ROLLOUTD_SANDBOX_DIR"):
            sweep_stale(Path(self.env["ROLLOUTD_SANDBOX_DIR"]))

    def daemon_pids(self) -> list[int]:
        try:
            state = json.loads((self.data_dir / "local-executor.json").read_text())
        except (OSError, ValueError):
            return []
        return [d["pid"] for slots in state.values() for d in slots.values()]

    # ------------------------------------------------------------ jobs

    def apply(self, doc: dict[str, Any]) -> dict[str, Any]:
        namespace, name = doc["metadata"].get("namespace") or "default", doc["metadata"]["name"]
        if namespace == "default":  # the old path is default's alone: rolloutctl's apply, create or update
            r = self.api.put(f"{P}/rolloutjobs/{name}", json=doc)
        else:  # the namespaced paths are Kubernetes': create, else update
            r = self.api.post(f"{P}/namespaces/{namespace}/rolloutjobs", json=doc)
            if r.status_code == 409:
                r = self.api.put(f"{P}/namespaces/{namespace}/rolloutjobs/{name}", json=doc)
        assert r.status_code in (200, 201), r.text
        return r.json()

    def get(self, name: str) -> dict[str, Any]:
        return self.api.get(f"{P}/rolloutjobs/{name}").json()

    def events(self, name: str, timeout: float = 300) -> Iterator[dict[str, Any]]:
        """The job's object after every change (a watch stream, reconnected as needed)."""
        since = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            params = {"watch": "true", "fieldSelector": f"metadata.name={name}",
                      "timeoutSeconds": max(deadline - time.monotonic(), 1)}
            if since:
                params["resourceVersion"] = since
            try:
                with self.api.stream("GET", f"{P}/rolloutjobs", params=params) as s:
                    ev: dict[str, str] = {}
                    for line in s.iter_lines():
                        if line == "":
                            if ev.get("event") in ("ADDED", "MODIFIED"):
                                since = ev["id"]
                                yield json.loads(ev["data"])
                            ev = {}
                        elif not line.startswith(":"):
                            k, _, v = line.partition(": ")
                            ev[k] = v
            except httpx.TransportError:
                time.sleep(0.2)  # controller restarting: reconnect
        raise TimeoutError(f"job {name}: no terminal phase within {timeout}s")

    def wait_until(self, name: str, pred, timeout: float = 300) -> dict[str, Any]:
        try:
            for obj in self.events(name, timeout):
                if pred(obj):
                    return obj
                if obj["status"].get("phase") in ("Failed", "Cancelled"):
                    raise AssertionError(f"job {name} ended {obj['status']['phase']}: {obj['status']}")
        except TimeoutError:
            pass
        raise TimeoutError(f"job {name}: condition not met within {timeout:g}s\n{self.diagnose(name)}")

    def diagnose(self, name: str, chars: int = 3000) -> str:
        """What a failed wait needs to be understood from CI output alone: the job's status, the
        item states, and the ends of the controller's and the daemons' logs."""
        out = []
        try:
            out.append(f"status: {json.dumps(self.get(name).get('status'))[:chars]}")
        except Exception as e:  # noqa: BLE001 - the controller may be the problem
            out.append(f"status: unavailable ({e!r})")
        try:
            with self.db() as db:
                rows = db.execute("SELECT state, count(*) FROM items WHERE job=? GROUP BY state", (name,)).fetchall()
            out.append(f"items: {dict(rows)}")
        except Exception as e:  # noqa: BLE001
            out.append(f"items: unavailable ({e!r})")
        logs = [self.root / "controller.log", *sorted((self.data_dir / "logs").glob(f"{name}-*.log"))]
        for path in logs:
            if path.exists():
                out.append(f"--- {path.name} (tail)\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def wait_done(self, name: str, timeout: float = 300) -> dict[str, Any]:
        return self.wait_until(name, lambda o: o["status"].get("phase") == "Succeeded", timeout)

    def trajectories(self, name: str) -> list[dict[str, Any]]:
        r = self.api.get(f"{P}/rolloutjobs/{name}/trajectories", params={"limit": 100000})
        assert r.status_code == 200, r.text
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]

    def db(self) -> sqlite3.Connection:
        """Read-only view of the controller's database (for observing leases in tests)."""
        return sqlite3.connect(f"file:{self.data_dir / 'rolloutd.db'}?mode=ro", uri=True, timeout=10)




def job_doc(name: str, engine, *, limit: int = 4, samples: int = 2, nodes: int = 1, tools=("bash", "submit"),
            max_turns: int = 2, tokens: int = 12, workers=(4, 8, 4), lease_seconds: float = 30,
            backends: list[str] | None = None, kind: str = "math", source: str | None = None,
            max_attempts: int = 3) -> dict[str, Any]:
    return {
        "apiVersion": "rolloutd.io/v1alpha1",
        "kind": "RolloutJob",
        "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": kind, "source": source or str(REPO / "examples" / "math" / "train.jsonl"),
                      "limit": limit},
            "samplesPerPrompt": samples,
            "agent": {"maxTurns": max_turns, "tools": list(tools),
                      "sampling": {"temperature": 1.0, "maxTokensPerTurn": tokens, "maxTotalTokens": 1024, "seed": 3}},
            "llm": {"tokenizer": str(engine.model_dir), "backends": [{"url": u} for u in (backends or [engine.url])]},
            "sandbox": {"runtime": "bwrap", "image": "host", "network": False,
                        "limits": {"memoryMB": 2048, "processes": 256, "wallSeconds": 600}},
            "executor": {"kind": "local", "nodes": nodes},
            "pipeline": {"workersPerNode": {"init": workers[0], "run": workers[1], "eval": workers[2]},
                         "leaseSeconds": lease_seconds, "maxAttempts": max_attempts},
            "timeouts": {"initSeconds": 60, "runSeconds": 300, "evalSeconds": 60, "actionSeconds": 20},
        },
    }


def gated_job_doc(name: str, engine, gate: Path, *, limit: int = 4, **kw) -> dict[str, Any]:
    """`job_doc` whose rollouts wait in INIT until the file `gate` exists (plug-in `gated`, needs
    `plugin_env()`): the job cannot finish before the test creates it, however fast the machine."""
    rows = [json.loads(line) for line in (REPO / "examples" / "math" / "train.jsonl").read_text().splitlines()
            if line.strip()][:limit]
    source = gate.parent / f"{name}-gated.jsonl"
    source.write_text("".join(json.dumps({**row, "gate": str(gate)}) + "\n" for row in rows))
    doc = job_doc(name, engine, kind="gated", source=str(source), limit=limit, **kw)
    doc["spec"]["timeouts"]["initSeconds"] = 900  # the gate is part of INIT
    return doc


def in_stage(cluster: "Cluster", name: str, stage: str) -> int:
    """Rollouts of the job in `stage` (init, run, eval), as its status counts them (the controller holds the
    stages daemons report in memory, not in the database; the status is refreshed every 2 s or on a change)."""
    return cluster.get(name).get("status", {}).get("counts", {}).get(stage, 0)


def held_at_gate(cluster: "Cluster", name: str) -> int:
    """Rollouts of the job in INIT (what a gated job's rollouts do until the gate opens)."""
    return in_stage(cluster, name, "init")
