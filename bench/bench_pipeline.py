"""Controller + node-daemon overhead per rollout, with the LLM and the tools taken out.

One run, 2 cores shared by everything (controller, 2 local node daemons, the stub, this script):
- **orchestration only** (what issue 5 asks): the `bench-noop` task kind (`tests/support/sim/plugins/`, a
  plug-in registered like tests/e2e/plugins) whose RUN and EVAL do nothing — no LLM call, no tool,
  no sandbox — so the job measures leases, heartbeats, exactly-once results in SQLite and the
  daemons' INIT/RUN/EVAL pools, `prompts × 8` rollouts;
- **stub-LLM rollout**: the same path with one-turn math rollouts without tools against an
  instant stub backend (`stub_backend.py`): chat template, tokenizer, an HTTP call per rollout,
  math EVAL — what the cheapest real rollout costs;
- **baseline** for each: the same `handler.run` + `handler.eval` calls in one process, no service.
Reported per job: rollouts/s *sustained* (first to last finished rollout, from the trajectories'
end stamps) and apply → Succeeded (which adds the daemons' start-up: Python imports and the
tokenizer, ~1–2 s), and CPU per rollout of the controller (target), the daemons and the stub
(from /proc, apply → Succeeded). Targets (issue 5): ≥ 200 rollouts/s sustained, ≤ 5 ms of
controller CPU per rollout. `$ROLLOUTD_PIPELINE_TRACING=both` runs the jobs with tracing off, then on (spans
exported over OTLP/HTTP to a receiver here), side by side (`on` alone, or `off`, the default);
`$ROLLOUTD_PIPELINE_JOBS=math` (or `noop`) runs one job of the two.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from support.sim.noop import NOOP, PLUGINS

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


def _cpu_times(pid: int) -> tuple[float, float]:
    """`pid`'s CPU seconds in its own code and in the kernel for it (utime, stime of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _cpu_seconds(pid: int) -> float:
    return sum(_cpu_times(pid))


def _dataset(tmp: Path, prompts: int) -> Path:
    path = tmp / "add.jsonl"
    path.write_text("".join(json.dumps({"id": f"a{i}", "question": f"What is {i % 7} + 2?", "answer": str(i % 7 + 2)})
                            + "\n" for i in range(prompts)))
    return path


def _job(name: str, source: Path, tokenizer: str, backend: str, prompts: int, samples: int,
         kind: str = "math") -> dict:
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": kind, "source": str(source), "limit": prompts},
            "samplesPerPrompt": samples,
            "agent": {"maxTurns": 1, "tools": [], "sampling": {"maxTokensPerTurn": 16, "seed": 1}},
            "llm": {"tokenizer": tokenizer, "backends": [{"url": backend}]},
            "executor": {"kind": "local", "nodes": 2},
            "pipeline": {"workersPerNode": {"init": 32, "run": 64, "eval": 32}},
        },
    }


def _in_process(source: Path, tokenizer: str, backend: str, prompts: int, samples: int, kind: str = "math") -> float:
    from rolloutd.agents.llm import SamplingParams
    from rolloutd.agents.vllm_backend import VLLMBackend
    from rolloutd.agents.tasks import get_handler
    from rolloutd.agents.tokenizer import ChatTokenizer
    from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext

    if kind == NOOP and str(PLUGINS) not in sys.path:
        sys.path.insert(0, str(PLUGINS))  # found through its dist-info, like in the daemons
    handler = get_handler(kind)
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


class _ChildCPU:
    """CPU seconds a process's children (the local executor's daemons) use from now on, sampled
    every 0.1 s while they live (they exit when their job ends)."""

    def __init__(self, parent: int) -> None:
        self.parent, self.seen, self._stop = parent, {}, threading.Event()
        self.before = self._sample()  # children already there (a previous job's daemons leaving)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _children(self) -> list[int]:
        try:  # the kernel's list of children, else a scan of /proc
            return [int(pid) for task in Path(f"/proc/{self.parent}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        except OSError:
            pids = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == self.parent:
                        pids.append(int(pid))
                except OSError:
                    pass
            return pids

    def _sample(self) -> dict[int, float]:
        out = {}
        for pid in self._children():
            try:
                out[pid] = _cpu_seconds(pid)
            except OSError:
                pass
        return out

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.seen.update(self._sample())
            self._stop.wait(0.1)

    def stop(self) -> float:
        time.sleep(0.3)
        self._stop.set()
        self._thread.join()
        return sum(cpu - self.before.get(pid, 0.0) for pid, cpu in self.seen.items())


def _measure(api: httpx.Client, ctl: int, stub: int, name: str, job: dict, n: int) -> dict:
    """Run one job; its rates and CPU per rollout."""
    children = _ChildCPU(ctl)
    cpu0, stub0 = _cpu_seconds(ctl), _cpu_seconds(stub)
    t0 = time.time()
    api.put(f"{P}/rolloutjobs/{name}", json=job).raise_for_status()
    _wait_phase(api, name, "Succeeded")
    wall = time.time() - t0
    cpu, stub_cpu = _cpu_seconds(ctl) - cpu0, _cpu_seconds(stub) - stub0
    daemons = children.stop()
    lines = api.get(f"{P}/rolloutjobs/{name}/trajectories", params={"limit": 100000}).text.splitlines()
    assert len(lines) == n, f"{len(lines)} trajectories for {n} rollouts"
    trajectories = [json.loads(line) for line in lines]
    assert all(t["failure"]["kind"] == "none" and t["reward"] is not None for t in trajectories)
    ends = sorted(t["timings"]["stamps"]["end"] for t in trajectories)
    return {"sustained": (n - 1) / (ends[-1] - ends[0]), "end_to_end": n / wall, "wall": wall,
            "ctl_ms": cpu / n * 1e3, "daemons_ms": daemons / n * 1e3, "stub_ms": stub_cpu / n * 1e3}


def _service(env: dict[str, str], port: int, tmp: Path, stub: int, source: Path, tokenizer: str, backend: str,
             prompts: int, samples: int, kinds: tuple[str, ...]) -> dict:
    """A controller with `env` (its daemons inherit it): a warm-up job, then the measured jobs (`kinds`)."""
    ctl, api = start_controller(tmp, port, env)
    try:  # warm-up job (page cache, the controller's first requests); not measured
        api.put(f"{P}/rolloutjobs/warm", json=_job("warm", source, tokenizer, backend, 2, 2)).raise_for_status()
        _wait_phase(api, "warm", "Succeeded")
        return {kind: _measure(api, ctl.pid, stub, f"bench-{i}",
                               _job(f"bench-{i}", source, tokenizer, backend, prompts, samples, kind), prompts * samples)
                for i, kind in enumerate(kinds)}
    finally:
        os.killpg(ctl.pid, signal.SIGTERM)
        ctl.wait(20)


def run(quick: bool = False) -> list[dict]:
    """`$ROLLOUTD_PIPELINE_TRACING`: `off` (the default), `on` (every process exports its spans over OTLP/HTTP to a
    receiver in this process that decodes and counts them), or `both`: a controller of each, one after the other,
    the jobs and their rows side by side with the on/off ratios of the CPU per rollout."""
    from rolloutd.agents.engine.model_dirs import prepare_model

    from bench.bench_tracing_scale import Receiver, traced

    prompts, samples = (32, 8) if quick else (250, 8)
    n = prompts * samples
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-pipeline-"))
    tokenizer = str(prepare_model("tiny"))
    source = _dataset(tmp, prompts)
    sport = _port()
    backend = f"http://127.0.0.1:{sport}"
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(sport), "--tokenizer",
                             tokenizer], cwd=REPO, start_new_session=True)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[os.environ.get("ROLLOUTD_PIPELINE_TRACING", "off")]
    jobs = os.environ.get("ROLLOUTD_PIPELINE_JOBS", "noop,math")   # or one of them
    kinds = tuple({"noop": NOOP, "math": "math"}[k] for k in jobs.split(","))
    receiver = Receiver()
    got: dict[bool, dict] = {}
    spans: dict[bool, dict] = {}
    try:
        _wait_http(backend + "/health")
        base = {kind: n / _in_process(source, tokenizer, backend, prompts, samples, kind) for kind in kinds}
        for on in modes:
            # the controller expands bench-noop jobs and its local daemons run them: both find the plug-in here
            with traced(on, receiver):
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS),
                                                                                 os.environ.get("PYTHONPATH")]))}
            receiver.take()
            got[on] = _service(env, _port(), tmp / f"data-{'on' if on else 'off'}", stub.pid, source, tokenizer,
                               backend, prompts, samples, kinds)
            time.sleep(1.0)   # the controller's last spans, sent as it stopped
            spans[on] = receiver.take()
    finally:
        os.killpg(stub.pid, signal.SIGTERM)
        stub.wait(20)
        receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for on in modes:
        label = "" if len(modes) == 1 and not on else f", tracing {'on' if on else 'off'}"
        for kind, what, base_what in (
                (NOOP, f"orchestration only: no-op RUN/EVAL, no LLM, no tools ({n} rollouts, 2 daemons{label})",
                 "the same no-op handler calls in one process (nothing to orchestrate)"),
                ("math", f"one-turn math rollout, instant LLM stub, no tools ({n} rollouts, 2 daemons{label})",
                 "the same handler calls + stub in one process, no service")):
            if kind not in kinds:
                continue
            m = got[on][kind]
            rows.append({"benchmark": what,
                         "ours": f"{m['sustained']:.0f} rollouts/s sustained ({m['end_to_end']:.0f}/s apply → "
                                 f"Succeeded incl. daemon start-up, {m['wall']:.1f} s)",
                         "baseline": f"{base_what}: {base[kind]:.0f} rollouts/s", "ratio": m["sustained"] / base[kind],
                         "target": "≥ 200 rollouts/s", "met": m["sustained"] >= 200})
            rows.append({"benchmark": f"controller CPU per rollout ({'no-op' if kind == NOOP else 'stub-LLM'} job{label})",
                         "ours": f"{m['ctl_ms']:.2f} ms (daemons {m['daemons_ms']:.2f} ms incl. start-up, "
                                 f"stub {m['stub_ms']:.2f} ms)",
                         "baseline": "-", "ratio": None, "target": "≤ 5 ms", "met": m["ctl_ms"] <= 5})
    if len(modes) == 2:
        for kind in kinds:
            off, on = got[False][kind], got[True][kind]
            rows.append({"benchmark": f"tracing on vs off, {'no-op' if kind == NOOP else 'stub-LLM'} job: CPU per rollout "
                                      f"(one run each; {sum(spans[True]['spans'].values()) / (len(kinds) * n + 4):.1f} "
                                      f"spans received per rollout over the jobs)",
                         "ours": f"controller {on['ctl_ms']:.2f} ms, daemons {on['daemons_ms']:.2f} ms, "
                                 f"job {on['wall']:.1f} s",
                         "baseline": f"controller {off['ctl_ms']:.2f} ms, daemons {off['daemons_ms']:.2f} ms, "
                                     f"job {off['wall']:.1f} s",
                         "ratio": on["ctl_ms"] / off["ctl_ms"], "target": "controller ≤ 1.05×",
                         "met": on["ctl_ms"] <= 1.05 * off["ctl_ms"]})
    return rows


def start_controller(data_dir: Path, port: int, env: dict[str, str]) -> tuple[subprocess.Popen, httpx.Client]:
    """A real `rolloutd controller` (its own session: killpg ends it and its local daemons) and a client."""
    ctl = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir",
                            str(data_dir), "--port", str(port), "--log-level", "warning"],
                           cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/healthz")
    token = (data_dir / "token").read_text().strip()
    return ctl, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


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
