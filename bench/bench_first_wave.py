"""A job's first wave on a node, as users feel it: INIT ready through a real controller and node daemon, beside
N bare bwraps at once (issue #29, goal 1: the "job start / node joining" bursts).

Where it sits: run by the bench runner (`python -m bench first_wave`) through `run(quick)`, or alone as
``python -m bench.bench_first_wave [--n 8,32] [--reps 2]``. `bench_burst.py` measures the pool alone; this one
the product's path: a real `rolloutd controller` (local executor, one node daemon) runs a job of N rollouts of the
`bench-noop` kind (tests/support/sim/plugins) with the `bash` tool, so each rollout's INIT acquires a bwrap sandbox;
its RUN and EVAL do nothing. The daemon registers, builds its warm pool and tells it to expect the first wave
(`JobConfig.first_wave`), loads the job's tokenizer (the tiny model's), then leases: the first N leases are the
first wave; with a warm pool it leases that wave no faster than the pool warms (agents/daemon/firstwave.py), the
rest waiting in the controller's queue. Rows per N (median over repetitions of each job's figures):

* **first wave, warmed while the tokenizer loads** (spec.sandbox.warm 2, the default): p95 of the N rollouts'
  INIT time (lease → sandbox acquired and the task staged, `Timings.init`); beside it, so that a wait moved out of
  INIT shows, the wave's makespan (the first lease → the last INIT done, from each trajectory's INIT stamp, its
  node wait before INIT and its INIT time) and the p95 of the time the rollouts were queued (`Timings.queue`);
* **first wave, no warm pool** (spec.sandbox.warm 0: every INIT creates its sandbox cold, leased all at once):
  the same;
* **baseline**: N ``bwrap --ro-bind / / --unshare-all --die-with-parent true`` at once, right after each job.

Next: the node-joining case of a running job is the same set-up path (registration → pool → tokenizer → lease).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from support.sim.noop import NOOP, PLUGINS, HealthServer

from bench.bench_burst import GOAL, bare_burst, p95
from bench.bench_pipeline import P, _port, _wait_phase, start_controller


def _job(name: str, source: Path, tokenizer: str, backend: str, n: int, warm: int) -> dict:
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": NOOP, "source": str(source), "limit": n},
            "samplesPerPrompt": 1,
            "agent": {"maxTurns": 1, "tools": ["bash"]},   # the bash tool: each rollout gets a sandbox in INIT
            "llm": {"tokenizer": tokenizer, "backends": [{"url": backend}]},
            "executor": {"kind": "local", "nodes": 1},
            "sandbox": {"warm": warm},
            "pipeline": {"workersPerNode": {"init": n, "run": n, "eval": n}},
        },
    }


def _wave(api, name: str, n: int) -> dict[str, float]:
    """The job's p95 INIT, its first wave's makespan (first lease → last INIT done) and p95 queue time, in ms."""
    lines = api.get(f"{P}/rolloutjobs/{name}/trajectories", params={"limit": 100000}).text.splitlines()
    got = [json.loads(line) for line in lines]
    bad = [t["failure"] for t in got if t["failure"]["kind"] != "none"]
    if len(got) != n or bad:
        raise RuntimeError(f"{name}: {len(got)} trajectories for {n} rollouts, failures {bad[:2]}")
    timings = [t["timings"] for t in got]
    leased = [tm["stamps"]["init"] - t["metrics"]["node_wait_init_seconds"] for t, tm in zip(got, timings)]
    done = [tm["stamps"]["init"] + tm["init"] for tm in timings]
    return {"init": p95([tm["init"] for tm in timings]), "makespan": (max(done) - min(leased)) * 1000,
            "queue": p95([tm["queue"] for tm in timings])}


def _settled(sandboxes: Path, limit: float = 120) -> None:
    """Until the node's sandboxes are all closed: a bare ``bwrap --ro-bind / /`` copies the host's mounts and fails
    when a workspace mount of a sandbox being closed vanishes under it."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if str(sandboxes) not in Path("/proc/self/mountinfo").read_text() and not any(sandboxes.iterdir()):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the node's sandboxes under {sandboxes} were not closed within {limit} s")


def measure(ns: list[int], reps: int) -> tuple[dict[int, list[dict]], tuple[float, float]]:
    from rolloutd.agents.engine.model_dirs import prepare_model

    load0 = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-first-wave-"))
    tokenizer = str(prepare_model("tiny"))
    source = tmp / "rows.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i}"}) + "\n" for i in range(max(ns))))
    health = HealthServer()
    sandboxes = tmp / "sandboxes"  # the node's own (the local executor's daemon inherits the controller's environment)
    sandboxes.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")])),
           "ROLLOUTD_SANDBOX_DIR": str(sandboxes)}
    ctl, api = start_controller(tmp / "data", _port(), env)
    got: dict[int, list[dict]] = {}
    try:
        k = 0
        for n in ns:
            got[n] = []
            for rep in range(reps):
                row = {}
                order = (2, 0) if rep % 2 else (0, 2)
                for warm in order:
                    k += 1
                    name = f"wave-{k}"
                    api.put(f"{P}/rolloutjobs/{name}", json=_job(name, source, tokenizer, health.urls[0], n,
                                                                  warm)).raise_for_status()
                    _wait_phase(api, name, "Succeeded")
                    row["warmed" if warm else "cold"] = _wave(api, name, n)
                    _settled(sandboxes)
                    row.setdefault("bare", [])
                    row["bare"].append(p95(asyncio.run(bare_burst(n))))
                row["bare"] = statistics.median(row["bare"])
                got[n].append(row)
            print(f"   N={n}: {got[n]}", file=sys.stderr, flush=True)
    finally:
        os.killpg(ctl.pid, signal.SIGTERM)
        ctl.wait(20)
        health.close()
    return got, (load0, os.getloadavg()[0])


def rows(got: dict[int, list[dict]], load: tuple[float, float]) -> list[dict]:
    out = []
    for n, reps in got.items():
        bare = statistics.median(r["bare"] for r in reps)
        for key, what in (("warmed", "warmed while the tokenizer loads (sandbox.warm 2)"),
                          ("cold", "no warm pool (sandbox.warm 0: every INIT cold)")):
            ratio = statistics.median(r[key]["init"] / r["bare"] for r in reps)
            med = {k: statistics.median(r[key][k] for r in reps) for k in ("init", "makespan", "queue")}
            out.append({
                "benchmark": f"first wave of {n} on a node daemon, p95 INIT (lease → sandbox ready): {what} "
                             f"({len(reps)} reps, load {load[0]:.1f}→{load[1]:.1f})",
                "ours": f"p95 {med['init']:.0f} ms (the wave: first lease → last INIT done {med['makespan']:.0f} ms; "
                        f"queued p95 {med['queue']:.0f} ms)",
                "baseline": f"{n} bare `bwrap --unshare-all true` at once: p95 {bare:.0f} ms",
                "ratio": round(ratio, 2),
                "target": f"≤ {GOAL}× bare" if key == "warmed" else "(reference)",
                "met": ratio <= GOAL if key == "warmed" else None,
            })
    return out


def run(quick: bool = False) -> list[dict]:
    got, load = measure([8, 32] if quick else [8, 32, 64], 1 if quick else 2)
    return rows(got, load)


def main() -> None:
    args = sys.argv[1:]
    ns = [int(x) for x in args[args.index("--n") + 1].split(",")] if "--n" in args else [8, 32, 64]
    reps = int(args[args.index("--reps") + 1]) if "--reps" in args else 2
    got, load = measure(ns, reps)
    print(f"load average (1 min) {load[0]:.2f} → {load[1]:.2f} on {os.cpu_count()} cores")
    from bench.__main__ import render

    print(render(rows(got, load)), end="")


if __name__ == "__main__":
    main()
