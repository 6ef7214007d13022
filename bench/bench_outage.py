"""Rollouts lost, re-run and delayed when the controller is away (killed, then restarted on the same data after an
outage of N seconds), with this checkout side by side with the branch's base (`git archive`, as `bench_scale`).

    python -m bench outage          (ROLLOUTD_BENCH_BASE=<rev> picks the "before" revision;
                                     writes bench/results/RESULTS-outage.md)

One controller per run (`--executors local`, one real node daemon), a job of ROLLOUTS `bench-noop` rollouts
(oracle agent, no LLM) that wait at INIT's gate, `leaseSeconds` LEASE and `maxAttempts: 1` (a rollout the controller
gives up on is an infrastructure failure, never re-run). Once all are held, the controller is killed (SIGKILL), the
gate opens (the rollouts finish while it is away), and after the outage it is started again. Per run: rollouts
scored, infra-failed, re-run (attempt > 1) and lost (no trajectory), the job's phase, and the delay from the restart
to the job's end. The daemons give up on a controller silent for 20 × leaseSeconds: outages stay below that.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_pipeline import NOOP, PLUGINS, REPO, _port, _wait_http
from bench.bench_scale import older_source

BASE_REV = os.environ.get("ROLLOUTD_BENCH_BASE", "991cd5e")  # before issue 37
HERE = Path(__file__).resolve().parent
P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
ROLLOUTS, LEASE = 16, 5.0
OUTAGES = (5, 20, 45)  # seconds; all below the daemons' 20 × LEASE (the promise: up to 10 × LEASE loses nothing)


class Controller:
    """A `rolloutd controller` on a fixed port and data dir, killed and started again at will."""

    def __init__(self, root: Path, src: Path | None) -> None:
        self.root, self.port = root, _port()
        path = [str(src)] if src else []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*path, str(PLUGINS),
                                                                               os.environ.get("PYTHONPATH")]))}
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.root / "controller.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(self.root / "data"),
             "--port", str(self.port), "--log-level", "info", "--executors", "local"],
            cwd=REPO, env=self.env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        _wait_http(self.url + "/healthz")
        token = (self.root / "data" / "token").read_text().strip()
        self.api = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        self.proc.wait(60)

    def daemons(self) -> list[int]:
        try:
            state = json.loads((self.root / "data" / "local-executor.json").read_text())
        except (OSError, ValueError):
            return []
        return [d["pid"] for slots in state.values() for d in slots.values()]

    def status(self) -> dict:
        return self.api.get(f"{P}/away").json().get("status", {})


def _until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if pred():
                return True
        time.sleep(0.1)
    return False


def one_run(src: Path | None, outage: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix="rolloutd-outage-"))
    gate, rows = root / "gate", root / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "gate": str(gate)}) + "\n" for i in range(ROLLOUTS)))
    ctl = Controller(root, src)
    ctl.start()
    try:
        job = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "away"}, "spec": {
            "tasks": {"kind": NOOP, "source": str(rows), "limit": ROLLOUTS}, "samplesPerPrompt": 1,
            "agent": {"kind": "oracle", "maxTurns": 1}, "executor": {"kind": "local", "nodes": 1},
            "pipeline": {"workersPerNode": {"init": ROLLOUTS, "run": ROLLOUTS, "eval": ROLLOUTS},
                         "leaseSeconds": LEASE, "maxAttempts": 1},
            "timeouts": {"initSeconds": 600}}}
        ctl.api.post(P, json=job).raise_for_status()
        if not _until(lambda: ctl.status().get("counts", {}).get("init") == ROLLOUTS, 120):
            raise RuntimeError(f"the rollouts were not all held at the gate: {ctl.status()}")
        ctl.kill()
        gate.touch()
        time.sleep(outage)  # the outage itself
        ctl.start()
        back = time.monotonic()
        ended = _until(lambda: ctl.status().get("phase") in ("Succeeded", "Failed"), 10 * LEASE + 60)
        delay = time.monotonic() - back
        got = [json.loads(line) for line in ctl.api.get(f"{P}/away/trajectories", params={"limit": 1000}).text
               .splitlines() if line.strip()]
        kinds = [t["failure"]["kind"] for t in got]
        return {"outage": outage, "phase": ctl.status().get("phase") if ended else "not ended",
                "scored": kinds.count("none"), "infra": kinds.count("infra"),
                "rerun": sum(1 for t in got if t.get("attempt", 1) > 1),
                "lost": ROLLOUTS - len({(t["prompt"], t["sample"]) for t in got}), "delay": round(delay, 1)}
    finally:
        pids = ctl.daemons()
        ctl.kill(signal.SIGTERM)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def run(quick: bool = False) -> list[dict]:
    outages = OUTAGES[:1] if quick else OUTAGES
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with older_source(BASE_REV) as old:
        for outage in outages:
            for variant, src in (("before", old), ("after", None)):
                results[variant].append(one_run(src, outage))
                print(variant, results[variant][-1], file=sys.stderr, flush=True)
    _write(results)
    rows = []
    for before, after in zip(results["before"], results["after"]):
        rows.append({"benchmark": f"controller away {before['outage']} s: rollouts scored of {ROLLOUTS}",
                     "ours": after["scored"], "baseline": before["scored"],
                     "ratio": after["scored"] / before["scored"] if before["scored"] else None,
                     "target": f"all {ROLLOUTS}", "met": after["scored"] == ROLLOUTS})
    return rows


def _write(results: dict[str, list[dict]]) -> None:
    lines = [f"# Controller outages: rollouts lost, re-run and delayed ({datetime.now(timezone.utc):%Y-%m-%d})", "",
             f"`python -m bench outage`: {ROLLOUTS} rollouts held at INIT on one node, `leaseSeconds` {LEASE:g}, "
             f"`maxAttempts` 1; the controller killed, the rollouts finish while it is away, it is restarted after "
             f"the outage. before: {BASE_REV}; after: this checkout.", "",
             "| outage | variant | phase | scored | infra | re-run | lost | restart → end (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for before, after in zip(results["before"], results["after"]):
        for name, r in (("before", before), ("after", after)):
            lines.append(f"| {r['outage']} s | {name} | {r['phase']} | {r['scored']} | {r['infra']} | {r['rerun']} | "
                         f"{r['lost']} | {r['delay']} |")
    (HERE / "results" / "RESULTS-outage.md").write_text("\n".join(lines) + "\n")
    (HERE / "results" / "outage.json").write_text(json.dumps(results, indent=1) + "\n")
