"""Two tenants on one real controller: the setup `bench_stalls` and `bench_tenancy` share (issue 36).

`two_teams(rows)` starts a `rolloutd controller` (`bench_scale.Controller`: the local executor asked for 0 nodes,
nothing starts) with a dataset of `rows` prompts and a stub backend; team-b holds a namespace token (its policy
lifts its request rate: the probe's loop is no tenant's), a small job and one registered node of it. `Teams.probe`
runs team-b's GET of its job and its node's heartbeat in turn for a window, with latencies in ms, while another
thread or process does team-a's worst. `sim_nodes` starts simulated daemons for a job (`tests/support/sim/simnodes.py`,
as `bench_scale` does): `bench_fairshare` runs several tenants' jobs on one shared backend with them. Next step:
the stall windows with simulated daemons of team-a running too.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.bench_scale import MEDIAN_SECONDS, P, REPO, SIGMA, Controller, HealthServer, _pct
from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.crds.node import FEATURES_PARAM, NODE_PROTOCOL, NODE_TOKEN
from support.sim import module_command


def job(name: str, source: Path, prompts: int, samples: int, backends: list[str]) -> dict:
    """A noop job over `source` that nothing runs: the controller expands it and waits for daemons. Its
    tokenizer is the dataset's directory (beneath ROLLOUTD_TOKENIZER_ROOTS, which `Controller` sets to the root):
    the controller refuses a tokenizer it cannot find ("none" was refused, which broke `bench tenancy`)."""
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": "bench-noop", "source": str(source), "limit": prompts},
            "samplesPerPrompt": samples,
            "agent": {"maxTurns": 1, "tools": []},
            "llm": {"tokenizer": str(source.parent), "backends": [{"url": u} for u in backends]},
            "executor": {"kind": "local", "nodes": 0},
        },
    }


def summary(xs: list[float], at: list[float] | None = None) -> dict:
    """n, p50, p99 and max of `xs` (ms); with `at` (each sample's start, s into the window) the three slowest
    samples as (s into the window, ms): where in a long window the stalls were."""
    if not xs:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan"), "worst": []}
    worst = sorted(zip(at, xs), key=lambda p: -p[1])[:3] if at is not None else []
    return {"n": len(xs), "p50": statistics.median(xs), "p99": _pct(xs, 0.99), "max": max(xs),
            "worst": [(round(t, 1), round(ms, 1)) for t, ms in worst]}


@dataclass
class Teams:
    root: Path
    source: Path
    health: HealthServer
    ctl: Controller
    b: httpx.Client  # team-b's namespace token
    mine: str  # team-b's job
    beat_path: str = ""
    node: httpx.Client | None = None  # team-b's node credential
    _closing: list = field(default_factory=list)

    def probe(self, seconds: float, stop: threading.Event | None = None, at_least: float = 0.0) -> dict:
        """team-b's GET and its node's heartbeat, in turn, for `seconds` (or until `stop`, once `at_least` s have
        passed): ms each."""
        gets: list[float] = []
        beats: list[float] = []
        get_at: list[float] = []
        beat_at: list[float] = []
        start = time.monotonic()
        end = start + seconds
        while time.monotonic() < end and not (stop and stop.is_set() and time.monotonic() >= start + at_least):
            t = time.perf_counter()
            get_at.append(time.monotonic() - start)
            self.b.get(self.mine).raise_for_status()
            gets.append((time.perf_counter() - t) * 1000)
            if self.node is not None:
                t = time.perf_counter()
                beat_at.append(time.monotonic() - start)
                self.node.post(self.beat_path, json={}).raise_for_status()
                beats.append((time.perf_counter() - t) * 1000)
        return {"get": summary(gets, get_at), "beat": summary(beats, beat_at)}

    def window(self, seconds: float, load) -> dict:
        """`probe` for `seconds` while `load(stop)` runs in a thread (None: idle)."""
        stop = threading.Event()
        worker = threading.Thread(target=load, args=(stop,)) if load else None
        if worker:
            worker.start()
        try:
            return self.probe(seconds)
        finally:
            stop.set()
            if worker:
                worker.join()


@contextlib.contextmanager
def two_teams(rows: int, prefix: str = "bench-teams-", src: Path | None = None) -> Iterator[Teams]:
    """`src`: an older rolloutd's packages to run the controller from (`bench_scale.older_source`)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        source = root / "rows.jsonl"
        source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(rows)))
        health = HealthServer()
        ctl = Controller(root, src)
        try:
            team_b = create_scoped_token(root / "data" / "tokens", "team-b", read_only=False, namespaces=["team-b"])
            if src is None:  # team-b's probe is a tight loop of ~200 GETs/s, no tenant's pattern: it measures the
                # controller, so its own request rate (quotas.requestsPerSecond, 50 by default) does not hold it
                ctl.api.put(f"{P}/tenantpolicies/team-b", json={
                    "apiVersion": "rolloutd.io/v1alpha1", "kind": "TenantPolicy", "metadata": {"name": "team-b"},
                    "spec": {"quotas": {"requestsPerSecond": 10_000, "requestBurst": 100_000}}}).raise_for_status()
            jobs = f"{P}/namespaces/team-b/rolloutjobs"
            ctl.api.post(jobs, json=job("small", source, 4, 1, health.urls[:1])).raise_for_status()
            credential = ctl.api.post(f"{jobs}/small/nodes/credential").json()["credential"]
            node = httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {credential}"}, timeout=120)
            reg = node.post(f"{jobs}/small/nodes/register", json={"job": "team-b/small", "name": "b-node",
                                                                   "protocol": NODE_PROTOCOL},
                            params={FEATURES_PARAM: NODE_TOKEN})
            reg.raise_for_status()
            node.headers["Authorization"] = f"Bearer {reg.json()['nodeToken']}"  # the node's own, from now on
            with httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {team_b.token}"},
                              timeout=120) as b, contextlib.closing(node):
                teams = Teams(root, source, health, ctl, b, f"{jobs}/small",
                              f"{jobs}/small/nodes/{reg.json()['nodeId']}/heartbeat", node)
                teams.probe(2.0)  # warm-up
                yield teams
        finally:
            ctl.stop()
            health.close()


def sim_nodes(ctl: Controller, namespace: str, name: str, nodes: int, slots: int, time_factor: float,
              start_at: float, stop_at: float, out: Path, seed: int = 0) -> subprocess.Popen:
    """`nodes` simulated daemons of job `namespace/name` with `slots` slots each, in a process of their own: rollouts
    of lognormal(median MEDIAN_SECONDS / `time_factor`) seconds from `start_at` to `stop_at` (wall clock); what
    the controller accepted and when, in `out` (JSON, `simnodes.Shard.run`) once the process exits."""
    r = ctl.api.post(f"{P}/namespaces/{namespace}/rolloutjobs/{name}/nodes/credential")
    r.raise_for_status()
    cfg = {"url": ctl.url, "credential": r.json()["credential"], "job": f"{namespace}/{name}", "slots": slots,
           "nodes": nodes, "first": 0, "time_factor": time_factor, "median_seconds": MEDIAN_SECONDS, "sigma": SIGMA,
           "seed": seed, "start_at": start_at, "stop_at": stop_at, "scaled_gap": True, "piggyback": True, "sync": True}
    config = out.with_suffix(".cfg.json")
    config.write_text(json.dumps(cfg))
    argv, env = module_command("simnodes", str(config), str(out))
    return subprocess.Popen(argv, env=env, cwd=REPO, start_new_session=True)
