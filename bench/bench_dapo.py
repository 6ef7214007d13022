"""Time to fill one batch of informative groups: rolloutd's asynchronous DAPO vs the synchronous
filter-and-regenerate loop of verl / SkyRL, on the same workload, through the same machinery.

Workload (seeded, identical for both sides): a dataset where 30 % of prompts are always solved,
30 % never, 40 % sometimes (each sample right with a per-prompt probability in [0.2, 0.8]) — only
groups with mixed rewards are informative — and long-tailed rollout times: each (prompt, sample)
generation takes a lognormal time (median `median` s, σ 1.0, capped). The time sits in the LLM
call, served by a bench-only stub engine (below) that knows each rollout's time from its request
id and honours `/abort_requests`; the reward comes from a bench-only task plug-in (`dapobench`,
registered through an entry point on `PYTHONPATH`, which the node daemons inherit) whose EVAL
returns the scripted reward. Every rollout gets a real bwrap sandbox.

- **ours**: one job with `spec.dapo` (targetGroups T, maxInFlightGroups T), one
  `RolloutClient.next_batch()`: groups are replaced as soon as they settle uninformative, and
  once T are counted the surplus is cancelled on the daemons.
- **baseline** (verl / SkyRL dynamic sampling): one job with `spec.batches` (T groups per batch,
  no filtering) and the synchronous loop — generate T groups, wait for ALL of them, keep the
  informative ones, generate another T, … until T informative groups are collected.
Both sides have at most T groups (T × n rollouts) in flight and start from the same prompt.

Reported: seconds to fill (median over repetitions), rollouts started, and — 1 s after our batch
is full — what is still alive: rollouts in the job's status, processes under the node daemons
(sandboxes, exec servers; read from /proc), and requests in flight at the engine.
Targets (issue 7): ≥ 1.5× faster; zero rollouts of the batch alive 1 s after it is full.

    python -m bench dapo [--quick]          (writes bench/results/RESULTS-dapo.md)
    python -m bench.bench_dapo stub ...     (the stub engine; started by the bench)
"""
# no `from __future__ import annotations`: the stub's FastAPI handlers need real annotations
import asyncio
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_pipeline import _port, _wait_http

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

PLUGIN = '''\
from typing import ClassVar

from rolloutd.agents.tasks.base import Reward
from rolloutd.agents.tasks.math import MathTask


class ScriptedTask(MathTask):
    """Bench only: the reward of sample s of a row is row["rewards"][s] (scripted, no grading)."""

    name: ClassVar[str] = "dapobench"
    needs_sandbox: ClassVar[bool] = True   # every rollout gets a sandbox, as in agentic RL

    async def eval(self, task, sandbox, trajectory):
        return Reward(value=float(task["rewards"][trajectory.sample]), details={"scripted": True})
'''


# ---------------------------------------------------------------- workload


def workload(prompts: int, samples: int, median: float, cap: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    kinds = ["right"] * round(0.3 * prompts) + ["wrong"] * round(0.3 * prompts)
    kinds += ["mixed"] * (prompts - len(kinds))
    rng.shuffle(kinds)
    rows = []
    for i, kind in enumerate(kinds):
        p = {"right": 1.0, "wrong": 0.0}.get(kind, rng.uniform(0.2, 0.8))
        rewards = [1.0 if rng.random() < p else 0.0 for _ in range(samples)]
        times = [round(min(cap, median * math.exp(rng.gauss(0.0, 1.0))), 3) for _ in range(samples)]
        rows.append({"id": f"q{i}", "question": f"Scripted question {i}?", "answer": "0", "kind": kind,
                     "rewards": rewards, "times": times})
    return rows


def informative(rewards: list[float]) -> bool:
    return len(rewards) > 1 and max(rewards) != min(rewards)


# ---------------------------------------------------------------- the stub engine


def stub_app(reply_ids: list[int], times: list[list[float]]):
    """vLLM's completions API, answering each rollout after its scripted time; `/abort_requests`
    (what a node daemon sends when it cancels a rollout) ends a request at once;
    `GET /inflight` lists the requests still being served."""
    from fastapi import FastAPI, Request

    app = FastAPI()
    inflight: dict[str, asyncio.Event] = {}
    rid_re = re.compile(r"-p(\d+)-s(\d+)-a\d+-")

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 4096}]}

    @app.get("/inflight")
    async def get_inflight():
        return {"inflight": len(inflight), "ids": sorted(inflight)}

    @app.post("/abort_requests")
    async def abort(request: Request):
        # a daemon names the engine's id of choice 0 (`cmpl-{rid}-0`) and the request id itself
        for rid in (await request.json()).get("request_ids", []):
            for key in (rid, rid.removeprefix("cmpl-").removesuffix("-0")):
                if key in inflight:
                    inflight[key].set()
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        rid = str(body.get("request_id", ""))
        m = rid_re.search(rid)
        delay = times[int(m.group(1)) % len(times)][int(m.group(2))] if m else 0.0
        ev = inflight[rid] = asyncio.Event()
        finish = "stop"
        try:
            end = time.monotonic() + delay
            while (left := end - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(ev.wait(), min(left, 0.1))
                except asyncio.TimeoutError:
                    pass
                if ev.is_set() or await request.is_disconnected():
                    finish = "abort"
                    break
        finally:
            inflight.pop(rid, None)
        n = min(len(reply_ids), int(body.get("max_tokens") or 16))
        ids = reply_ids[:n] if finish == "stop" else []
        return {"id": f"cmpl-{rid}", "object": "text_completion", "model": "stub",
                "choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": None,
                             "token_ids": ids, "prompt_token_ids": body["prompt"],
                             "logprobs": {"token_logprobs": [-0.1] * len(ids),
                                          "tokens": [f"token_id:{i}" for i in ids],
                                          "top_logprobs": None, "text_offset": [0] * len(ids)}}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids), "total_tokens": 0}}

    return app


def stub_main(argv: list[str]) -> None:
    import argparse

    import uvicorn

    from bench.stub_backend import reply_for

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--times", required=True, help="JSON file: times[prompt][sample] in seconds")
    args = ap.parse_args(argv)
    times = json.loads(Path(args.times).read_text())
    uvicorn.run(stub_app(reply_for(args.tokenizer), times), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


# ---------------------------------------------------------------- helpers


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pids: list[int]) -> list[str]:
    """Command lines of every live process below `pids` (the node daemons): sandboxes, exec servers."""
    kids, out, todo = _children(), [], list(pids)
    while todo:
        for c in kids.get(todo.pop(), []):
            try:
                state = Path(f"/proc/{c}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if state not in ("Z", "X"):
                out.append(f"{c}: {cmd[:120]}")
            todo.append(c)
    return out


def daemon_pids(data_dir: Path, job: str) -> list[int]:
    state = _json(data_dir / "local-executor.json")
    return [d["pid"] for slot_job, slots in state.items() if slot_job == job for d in slots.values()]


def job_doc(name: str, source: Path, tokenizer: str, backend: str, samples: int, workers: int, nodes: int) -> dict:
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": "dapobench", "source": str(source)},
            "samplesPerPrompt": samples,
            "agent": {"maxTurns": 1, "tools": [], "sampling": {"maxTokensPerTurn": 16, "seed": 1}},
            "llm": {"tokenizer": tokenizer, "backends": [{"url": backend}]},
            # warm 0: the "alive after the batch" probe then counts rollouts' sandboxes only
            "sandbox": {"runtime": "bwrap", "image": "host", "network": False, "warm": 0},
            "executor": {"kind": "local", "nodes": nodes},
            "pipeline": {"workersPerNode": {"init": workers, "run": workers, "eval": workers}},
            "timeouts": {"initSeconds": 120, "runSeconds": 300, "evalSeconds": 60},
        },
    }


class Env:
    """A controller (with the plug-in on its PYTHONPATH) and the stub engine, for one workload."""

    def __init__(self, tmp: Path, rows: list[dict]):
        from rolloutd.agents.engine.model_dirs import prepare_model

        self.tmp, self.rows = tmp, rows
        self.tokenizer = str(prepare_model("tiny"))
        self.source = tmp / "scripted.jsonl"
        self.source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp / "times.json").write_text(json.dumps([r["times"] for r in rows]))
        plugin = tmp / "plugin"
        (plugin / "dapobench-0.1.dist-info").mkdir(parents=True)
        (plugin / "dapobench-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: dapobench\nVersion: 0.1\n")
        (plugin / "dapobench-0.1.dist-info" / "entry_points.txt").write_text(
            "[rolloutd.tasks]\ndapobench = dapo_bench_task:ScriptedTask\n")
        (plugin / "dapo_bench_task.py").write_text(PLUGIN)
        self.plugin = plugin
        self.procs: list[subprocess.Popen] = []
        self.data_dir = tmp / "data"

    def start(self) -> "Env":
        sport, cport = _port(), _port()
        self.backend = f"http://127.0.0.1:{sport}"
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "bench.bench_dapo", "stub", "--port", str(sport), "--tokenizer", self.tokenizer,
             "--times", str(self.tmp / "times.json")], cwd=REPO, start_new_session=True))
        _wait_http(self.backend + "/health")
        env = {**os.environ, "PYTHONPATH": f"{self.plugin}:{os.environ.get('PYTHONPATH', '')}"}
        self.data_dir = self.tmp / "data"
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(self.data_dir),
             "--port", str(cport), "--executors", "local", "--log-level", "warning"],
            cwd=REPO, env=env, start_new_session=True, stdout=open(self.tmp / "controller.log", "ab"),
            stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{cport}"
        _wait_http(self.url + "/healthz")
        return self

    def client(self):
        from rolloutd.client import RolloutClient

        return RolloutClient(self.url, token=(self.data_dir / "token").read_text().strip(), timeout=60)

    def stop(self) -> None:
        daemons = [d["pid"] for slots in _json(self.data_dir / "local-executor.json").values() for d in slots.values()]
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        for pid in daemons:  # never leave a node daemon behind
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _ready(env: "Env", rc, name: str, nodes: int, timeout: float = 180) -> None:
    """Every daemon registered and its pools up (task handler and tokenizer loaded): the clock
    starts with the work, not with Python start-up. Read from the daemons' own logs."""
    deadline = time.monotonic() + timeout
    logs = [env.data_dir / "logs" / f"{name}-node{i}.log" for i in range(nodes)]
    while time.monotonic() < deadline:
        nodes_up = (rc.get(name).get("status") or {}).get("nodes", 0) >= nodes
        if nodes_up and all(p.exists() and " pools init=" in p.read_text(errors="replace") for p in logs):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name}: daemons not ready after {timeout:g}s (see {env.data_dir / 'logs'})")


class Probe(threading.Thread):
    """Peak processes under the daemons and requests at the engine while the batch fills."""

    def __init__(self, env: "Env", name: str):
        super().__init__(daemon=True)
        self.env, self.name, self.procs, self.engine = env, name, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            self.procs = max(self.procs, len(descendants(daemon_pids(self.env.data_dir, self.name))))
            try:
                self.engine = max(self.engine, httpx.get(self.env.backend + "/inflight", timeout=5).json()["inflight"])
            except httpx.HTTPError:
                pass

    def start(self) -> "Probe":
        super().start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.join()


def run_ours(env: Env, name: str, target: int, samples: int, workers: int, nodes: int) -> dict:
    doc = job_doc(name, env.source, env.tokenizer, env.backend, samples, workers, nodes)
    doc["spec"]["dapo"] = {"enabled": True, "targetGroups": target, "maxInFlightGroups": target}
    with env.client() as rc:
        rc.apply(doc)
        _ready(env, rc, name, nodes)
        probe = Probe(env, name).start()  # shows the probes below do see live sandboxes and requests
        t0 = time.monotonic()
        batch = rc.next_batch(name, timeout=900)
        full = time.monotonic()
        probe.stop()
        wall = full - t0
        # 1 s after the batch is full nothing of it may be alive: not in the job's counts, not
        # under the daemons (sandboxes, exec servers), not at the engine
        time.sleep(max(0.0, full + 1.0 - time.monotonic()))
        procs = descendants(daemon_pids(env.data_dir, name))
        engine = httpx.get(env.backend + "/inflight", timeout=10).json()
        counts = rc.get(name)["status"]["counts"]
        alive_rollouts = sum(counts.get(k, 0) for k in ("init", "run", "eval"))
        everything = rc.batch(name, batch.batch, wait=False, all_groups=True)
        started = sum(len(g.samples) for g in everything.groups)
        assert batch.counted == target and all(informative(g.rewards) for g in batch.groups)
        arrays = batch.to_arrays()
        assert len(arrays["input_ids"]) == target * samples
        rc.delete(name, wait=True, timeout=120)
    return {"seconds": wall, "server_seconds": batch.seconds_to_fill, "opened": batch.opened_groups,
            "finished_rollouts": started, "cancelled": batch.cancelled_rollouts, "never_started": batch.never_started,
            "alive_rollouts": alive_rollouts, "alive_procs": procs, "engine_inflight": engine["inflight"],
            "peak_procs": probe.procs, "peak_engine": probe.engine}


def run_baseline(env: Env, name: str, target: int, samples: int, workers: int, nodes: int) -> dict:
    doc = job_doc(name, env.source, env.tokenizer, env.backend, samples, workers, nodes)
    doc["spec"]["batches"] = {"groups": target}
    kept, rounds, rollouts = 0, 0, 0
    with env.client() as rc:
        rc.apply(doc)
        _ready(env, rc, name, nodes)
        t0 = time.monotonic()
        while kept < target:  # verl / SkyRL: generate, wait for all, filter, regenerate
            batch = rc.next_batch(name, timeout=900)
            rounds += 1
            rollouts += sum(len(g.samples) for g in batch.groups)
            kept += sum(1 for g in batch.groups if informative(g.rewards))
        wall = time.monotonic() - t0
        rc.delete(name, wait=True, timeout=120)
    return {"seconds": wall, "rounds": rounds, "finished_rollouts": rollouts}


def run(quick: bool = False) -> list[dict]:
    target, samples, nodes = (4, 4, 2) if quick else (8, 8, 2)
    median, cap = (0.5, 6.0) if quick else (1.0, 20.0)
    reps = 1 if quick else 5
    workers = max(8, target * samples // nodes)
    ours, base = [], []
    for rep in range(reps):
        tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-dapo-"))
        env = Env(tmp, workload(prompts=256, samples=samples, median=median, cap=cap, seed=100 + rep)).start()
        try:  # alternate the order so neither side always runs on a warmer machine
            order = [("ours", run_ours), ("base", run_baseline)]
            for side, fn in (order if rep % 2 == 0 else order[::-1]):
                res = fn(env, f"{side}-{rep}", target, samples, workers, nodes)
                (ours if side == "ours" else base).append(res)
                print(f"   rep {rep} {side}: {res}", file=sys.stderr, flush=True)
        finally:
            env.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # kept when a repetition failed, for its logs
    t_ours = statistics.median(r["seconds"] for r in ours)
    t_base = statistics.median(r["seconds"] for r in base)
    ratio = statistics.median(b["seconds"] / o["seconds"] for o, b in zip(ours, base))  # paired: same workload
    alive = max(r["alive_rollouts"] for r in ours)
    procs = max(len(r["alive_procs"]) for r in ours)
    engine = max(r["engine_inflight"] for r in ours)
    leftover = [p for r in ours for p in r["alive_procs"]]
    rows = [
        {"benchmark": f"time to fill a batch of {target} informative groups × {samples} samples "
                      f"(30/30/40 % right/wrong/mixed prompts, lognormal rollout times, median {median:g} s)",
         "ours": f"{t_ours:.1f} s (async DAPO; {statistics.median(r['finished_rollouts'] for r in ours):.0f} "
                 f"rollouts finished, {statistics.median(r['cancelled'] for r in ours):.0f} cancelled)",
         "baseline": f"{t_base:.1f} s (sync filter-and-regenerate, "
                     f"{statistics.median(r['rounds'] for r in base):.0f} rounds, "
                     f"{statistics.median(r['finished_rollouts'] for r in base):.0f} rollouts)",
         "ratio": ratio, "target": "≥ 1.5×", "met": ratio >= 1.5},
        {"benchmark": "rollouts of the batch alive 1 s after it is full (job counts / processes under "
                      "the daemons / requests at the engine)",
         "ours": f"{alive} / {procs} / {engine}", "baseline": "-", "ratio": None, "target": "0 / 0 / 0",
         "met": alive == 0 and procs == 0 and engine == 0},
    ]
    _write(rows, quick, reps, ours, base, leftover)
    return rows


def _write(rows: list[dict], quick: bool, reps: int, ours: list[dict], base: list[dict], leftover: list[str]) -> None:
    from bench.__main__ import render

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    per_rep = "\n".join(
        f"| {i} | {o['seconds']:.1f} s ({o['opened']} groups opened, {o['cancelled']} cancelled, "
        f"{o['never_started']} never started) | {b['seconds']:.1f} s ({b['rounds']} rounds) | "
        f"{b['seconds'] / o['seconds']:.2f}× | {o['peak_procs']} / {o['peak_engine']} |" for i, (o, b) in enumerate(zip(ours, base)))
    text = (f"# DAPO benchmark\n\n`python -m bench dapo{' --quick' if quick else ''}` on {platform.node()} "
            f"({platform.machine()}, {os.cpu_count()} cores), {stamp}. {reps} repetition(s), each a fresh "
            f"controller and workload (seed 100 + rep) run by both sides in alternating order; times are "
            f"medians, the ratio is the median of the per-repetition ratios.\n\n{render(rows)}\n"
            f"Per repetition (the last column: peak processes under the daemons / requests at the engine "
            f"while the batch filled, i.e. what the 1 s probes would have seen had anything been left):\n\n"
            f"| rep | ours | baseline | ratio | peak while filling |\n|---|---|---|---|---|\n{per_rep}\n")
    if leftover:
        text += "\nStill alive 1 s after full:\n\n" + "\n".join(f"- `{p}`" for p in leftover) + "\n"
    (HERE / "results" / "RESULTS-dapo.md").write_text(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["stub"]:
        stub_main(sys.argv[2:])
    else:
        from bench.__main__ import render

        print(render(run(quick="--quick" in sys.argv)))
