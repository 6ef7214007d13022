"""Controller + node-daemon overhead per rollout, with the LLM and the tools taken out.

Side by side in one run, against an instant stub backend (`stub_backend.py`):
- **ours**: the full service path — controller (leases, heartbeats, exactly-once results in
  SQLite) + 2 local node daemons (INIT/RUN/EVAL pools, chat template, LLM client, EVAL) — for
  `prompts × 8` one-turn math rollouts without tools;
- **baseline**: the same handler.run + handler.eval calls in one process, no service at all.
Reported: rollouts/s of each, and the controller's CPU time per rollout (from /proc).
Targets (issue 5): ≥ 200 rollouts/s sustained, ≤ 5 ms of controller CPU per rollout.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
P = "/apis/rolloutd.io/v1alpha1"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _dataset(tmp: Path, prompts: int) -> Path:
    path = tmp / "add.jsonl"
    path.write_text("".join(json.dumps({"id": f"a{i}", "question": f"What is {i % 7} + 2?", "answer": str(i % 7 + 2)})
                            + "\n" for i in range(prompts)))
    return path


def _job(name: str, source: Path, tokenizer: str, backend: str, prompts: int, samples: int) -> dict:
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": "math", "source": str(source), "limit": prompts},
            "samplesPerPrompt": samples,
            "agent": {"maxTurns": 1, "tools": [], "sampling": {"maxTokensPerTurn": 16, "seed": 1}},
            "llm": {"tokenizer": tokenizer, "backends": [{"url": backend}]},
            "executor": {"kind": "local", "nodes": 2},
            "pipeline": {"workersPerNode": {"init": 32, "run": 64, "eval": 32}},
        },
    }


def _in_process(source: Path, tokenizer: str, backend: str, prompts: int, samples: int) -> float:
    from rolloutd.agents.llm import SamplingParams, VLLMBackend
    from rolloutd.agents.tasks import get_handler
    from rolloutd.agents.tokenizer import ChatTokenizer
    from rolloutd.agents.types import AgentConfig, RolloutContext

    handler = get_handler("math")
    tasks = handler.load(source, prompts)
    tok = ChatTokenizer(tokenizer)
    cfg = AgentConfig(max_turns=1, max_tokens_per_turn=16, tools=[], sampling=SamplingParams(seed=1))

    async def go() -> float:
        sem = asyncio.Semaphore(128)
        async with VLLMBackend(backend) as llm:
            async def one(p: int, s: int) -> None:
                async with sem:
                    t = await handler.run(tasks[p], None, llm, tokenizer=tok, config=cfg,
                                          ctx=RolloutContext(job="b", prompt=p, sample=s))
                    await handler.eval(tasks[p], None, t)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(p, s) for p in range(len(tasks)) for s in range(samples)))
            return time.perf_counter() - t0

    return asyncio.run(go())


def run(quick: bool = False) -> list[dict]:
    from rolloutd.agents.models import prepare_model

    prompts, samples = (32, 8) if quick else (125, 8)
    n = prompts * samples
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-pipeline-"))
    tokenizer = str(prepare_model("tiny"))
    source = _dataset(tmp, prompts)
    sport, cport = _port(), _port()
    backend = f"http://127.0.0.1:{sport}"
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(sport), "--tokenizer",
                             tokenizer], cwd=REPO, start_new_session=True)
    ctl = None
    try:
        _wait_http(backend + "/health")
        baseline = _in_process(source, tokenizer, backend, prompts, samples)

        ctl = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir",
                                str(tmp / "data"), "--port", str(cport), "--log-level", "warning"],
                               cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{cport}"
        _wait_http(url + "/healthz")
        token = (tmp / "data" / "token").read_text().strip()
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        # warm-up job: daemons import and load the tokenizer; not measured
        api.put(f"{P}/rolloutjobs/warm", json=_job("warm", source, tokenizer, backend, 2, 2)).raise_for_status()
        _wait_phase(api, "warm", "Succeeded")
        cpu0 = _cpu_seconds(ctl.pid)
        api.put(f"{P}/rolloutjobs/bench", json=_job("bench", source, tokenizer, backend, prompts, samples)).raise_for_status()
        _wait_phase(api, "bench", "Running")
        t0 = time.perf_counter()
        _wait_phase(api, "bench", "Succeeded")
        wall = time.perf_counter() - t0
        cpu = _cpu_seconds(ctl.pid) - cpu0
        lines = api.get(f"{P}/rolloutjobs/bench/trajectories", params={"limit": 100000}).text.splitlines()
        assert len(lines) == n, f"{len(lines)} trajectories for {n} rollouts"
    finally:
        for proc in (stub, ctl):
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(20)
    ours, base = n / wall, n / baseline
    return [
        {"benchmark": f"rollout throughput, instant LLM, no tools ({n} rollouts, 2 daemons)",
         "ours": f"{ours:.0f} rollouts/s through controller + daemons",
         "baseline": f"{base:.0f} rollouts/s in one process, no service", "ratio": ours / base,
         "target": "≥ 200 rollouts/s", "met": ours >= 200},
        {"benchmark": "controller CPU per rollout", "ours": f"{cpu / n * 1e3:.2f} ms",
         "baseline": "-", "ratio": None, "target": "≤ 5 ms", "met": cpu / n <= 0.005},
    ]


def _wait_phase(api: httpx.Client, name: str, phase: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    with api.stream("GET", f"{P}/rolloutjobs", params={"watch": "true", "fieldSelector": f"metadata.name={name}",
                                                        "timeoutSeconds": timeout}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and f'"phase":"{phase}"' in line:
                return
            if line.startswith("data: ") and '"phase":"Failed"' in line:
                raise RuntimeError(f"{name} failed: {line[:500]}")
            if time.monotonic() > deadline:
                break
    raise RuntimeError(f"{name} did not reach {phase}")


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
