"""Rollout throughput with 1, 2 and 4 Slurm nodes on an I/O-bound workload.

Side by side in one run, on a real Slurm 22.05 (slurmctld + 4 slurmd on this machine, started by
sim/minicluster.py, reused if running): the same job — one-turn math rollouts, no tools —
through the controller's `slurm` executor with `nodes` = 1, 2, 4. The LLM backend is the stub
(`stub_backend.py --latency-ms`), which answers every completion after a fixed delay, concurrently:
a rollout's time is dominated by waiting on the backend, as with a real remote vLLM fleet, and
each node daemon runs at most `workersPerNode.run` rollouts at once, so capacity is per node.

Reported per node count: steady throughput (rollouts/s between the 10th and 90th percentile of
completion times, so daemon start-up is not counted), end-to-end wall time from `apply` to
`Succeeded` (includes sbatch, Slurm's start and the daemons' start-up), and the scaling ratio
against 1 node. Targets (issue 6): scaling efficiency ≥ 0.9, i.e. ≥ 1.8× with 2 nodes and ≥ 3.6× with 4. On a 2-core machine
all "nodes" share the same two cores, so a backend latency much shorter than 500 ms turns the
measurement into one of this machine's CPU (at 200 ms: 1.8× and 2.5×, 4 daemons + controller +
stub on 2 cores), not of the executor.

    python -m bench slurm            (needs root and the Slurm packages: `make setup`)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_pipeline import P, REPO, _dataset, _port, _wait_http, _wait_phase

LATENCY_MS = int(os.environ.get("ROLLOUTD_BENCH_LATENCY_MS", "1000"))
RUN_WORKERS = 4


def _job(name: str, source: Path, tokenizer: str, backend: str, prompts: int, samples: int, nodes: int) -> dict:
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": "math", "source": str(source), "limit": prompts},
            "samplesPerPrompt": samples,
            "agent": {"maxTurns": 1, "tools": [], "sampling": {"maxTokensPerTurn": 16, "seed": 1}},
            "llm": {"tokenizer": tokenizer, "backends": [{"url": backend}]},
            "executor": {"kind": "slurm", "nodes": nodes, "slurm": {"extraArgs": ["--exclusive"]}},
            "pipeline": {"workersPerNode": {"init": RUN_WORKERS, "run": RUN_WORKERS, "eval": RUN_WORKERS}},
        },
    }


def _steady_rate(ends: list[float]) -> float:
    ends = sorted(ends)
    lo, hi = int(len(ends) * 0.1), int(len(ends) * 0.9) - 1
    span = ends[hi] - ends[lo]
    return (hi - lo) / span if span > 0 else float("nan")


def run(quick: bool = False) -> list[dict]:
    from support.sim.minicluster import MiniSlurm

    from rolloutd.agents.engine.model_dirs import prepare_model

    slurm = MiniSlurm().start()  # in $ROLLOUTD_SLURM_DIR, else /tmp/rolloutd-slurm
    prompts, samples = (20, 8) if quick else (50, 8)
    n = prompts * samples
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-slurm-"))
    tokenizer = str(prepare_model("tiny"))
    source = _dataset(tmp, prompts)
    sport, cport = _port(), _port()
    backend = f"http://127.0.0.1:{sport}"
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(sport), "--tokenizer",
                             tokenizer, "--latency-ms", str(LATENCY_MS)], cwd=REPO, start_new_session=True)
    ctl = None
    results: dict[int, tuple[float, float]] = {}
    try:
        _wait_http(backend + "/health")
        env = slurm.env({**os.environ, "ROLLOUTD_DRAIN_SECONDS": "5"})
        ctl = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir",
                                str(tmp / "data"), "--port", str(cport), "--log-level", "warning",
                                "--executors", "slurm"],
                               cwd=REPO, start_new_session=True, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{cport}"
        _wait_http(url + "/healthz")
        token = (tmp / "data" / "token").read_text().strip()
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        # warm-up: the first daemon start fills the page cache (imports, tokenizer); not measured
        api.put(f"{P}/rolloutjobs/warm", json=_job("warm", source, tokenizer, backend, 2, 2, 1)).raise_for_status()
        _wait_phase(api, "warm", "Succeeded")
        for nodes in (1, 2, 4):
            name = f"bench-{nodes}"
            t0 = time.perf_counter()
            api.put(f"{P}/rolloutjobs/{name}",
                    json=_job(name, source, tokenizer, backend, prompts, samples, nodes)).raise_for_status()
            _wait_phase(api, name, "Succeeded")
            wall = time.perf_counter() - t0
            lines = api.get(f"{P}/rolloutjobs/{name}/trajectories", params={"limit": 100000}).text.splitlines()
            trajs = [json.loads(x) for x in lines if x.strip()]
            assert len(trajs) == n, f"{len(trajs)} trajectories for {n} rollouts"
            used = len({t["node"] for t in trajs})
            assert used == nodes, f"{used} nodes did work, {nodes} asked for"
            results[nodes] = (_steady_rate([t["timings"]["stamps"]["end"] for t in trajs]), wall)
            _wait_no_allocations(slurm)
    finally:
        for proc in (ctl, stub):
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(20)
        slurm.release()
    base_rate, base_wall = results[1]
    rows = []
    for nodes, target in ((2, 1.8), (4, 3.6)):
        rate, wall = results[nodes]
        rows.append({
            "benchmark": f"Slurm executor: {n} I/O-bound rollouts ({LATENCY_MS} ms backend, {RUN_WORKERS} per node), "
                         f"{nodes} nodes vs 1",
            "ours": f"{rate:.1f} rollouts/s steady ({wall:.1f} s apply→Succeeded)",
            "baseline": f"{base_rate:.1f} rollouts/s with 1 node ({base_wall:.1f} s)",
            "ratio": rate / base_rate, "target": f"≥ {target}×", "met": rate / base_rate >= target})
    return rows


def _wait_no_allocations(slurm, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while [j for j in slurm.jobs() if j["name"].startswith("rolloutd-")]:
        if time.monotonic() > deadline:
            raise RuntimeError("allocations left in squeue")
        time.sleep(0.2)


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
