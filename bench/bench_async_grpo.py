"""The example GRPO trainer (`examples/train_grpo.py`) run asynchronously (`--prefetch`: batch k+1 generates while
batch k trains) with spec.policy.updateMode drain vs keep, on the tiny model: steps/s, the trainer's wait at each
announce and the engine's idle share, side by side in one run (one engine, one controller, same seed and settings).

The trainer runs in the engine venv (torch) and talks to this tree's controller over HTTP (`--server`), the engine
given by `--engine-url`. Nothing is installed anywhere.

    python -m bench async_grpo [--quick]          (writes bench/results/RESULTS-async-grpo.md)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_async_update import TokenClock
from bench.bench_pipeline import _port, start_controller

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENGINE_PY = Path(os.environ.get("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd") / "engine" / "venv" / "bin" / "python"
MODES = ("drain", "keep")


def _idle_share(clock: TokenClock, start: float, end: float) -> float:
    idle, prev = 0.0, None
    for t, n in clock.samples:
        if t < start or t > end:
            continue
        if prev is not None and n == prev[1]:
            idle += t - prev[0]
        prev = (t, n)
    return idle / max(end - start, 1e-9)


def _train(mode: str, steps: int, engine_url: str, server: str, token: Path, out: Path) -> dict:
    cmd = [str(ENGINE_PY), str(REPO / "examples" / "train_grpo.py"), "--model", "tiny", "--steps", str(steps),
           "--groups", "4", "--samples", "4", "--max-tokens", "256", "--heldout", "", "--engine-url", engine_url,
           "--server", server, "--token-file", str(token), "--name", f"grpo-{mode}", "--out", str(out),
           "--update-mode", mode, "--prefetch", "--max-minutes", "15"]
    env = {**os.environ, "ROLLOUTD_TRAIN_REEXEC": "1"}  # never re-installs: the engine venv imports the client
    subprocess.run(cmd, check=True, env=env, cwd=REPO, timeout=1800)
    return json.loads((out / "summary.json").read_text())


def run(quick: bool = False) -> list[dict]:
    from rolloutd.agents.engine.server import EngineServer

    steps = 3 if quick else 6
    engine = EngineServer("tiny", dtype="float32").start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    ctl, api = start_controller(tmp / "data", _port(), dict(os.environ))
    clock = TokenClock(engine.url)
    results = []
    try:
        for mode in MODES:
            start = time.monotonic()
            summary = _train(mode, steps, engine.url, str(api.base_url).rstrip("/"), tmp / "data" / "token", tmp / mode)
            end = time.monotonic()
            rows = summary["steps"][1:]  # the first step has nothing in flight at its announce
            results.append({"mode": mode, "steps": len(summary["steps"]), "seconds": summary["train_seconds"],
                            "sync": sum(r["sync_s"] for r in rows) / max(len(rows), 1),
                            "rollout": sum(r["rollout_s"] for r in rows) / max(len(rows), 1),
                            "idle": _idle_share(clock, start, end),
                            "stale": sum(r["stale_samples"] for r in summary["steps"]),
                            "reward": summary["steps"][-1]["reward_mean"]})
    finally:
        clock.stop()
        os.killpg(ctl.pid, signal.SIGTERM)
        ctl.wait(timeout=60)
        engine.stop()
    for r in results:
        r["rate"] = r["steps"] / r["seconds"]
    base = results[0]
    lines = ["# Asynchronous GRPO (examples/train_grpo.py --prefetch): drain vs keep", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
             f"tiny model, 4 groups × 4 samples, ≤ 256 tokens, {steps} steps. `python -m bench async_grpo"
             f"{' --quick' if quick else ''}`.", "",
             "| mode | steps/s | trainer wait at announce (s, mean from step 2) | wait for the batch (s) | "
             "engine idle share | samples one version behind | last reward |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['rate']:.3f} | {r['sync']:.2f} | {r['rollout']:.2f} | {r['idle']:.0%} | "
              f"{r['stale']} | {r['reward']} |" for r in results]
    (HERE / "results" / "RESULTS-async-grpo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return [{"benchmark": f"async GRPO, {r['mode']} ({steps} steps, tiny)", "ours": f"{r['rate']:.3f} steps/s",
             "baseline": f"{base['rate']:.3f} steps/s (drain)", "ratio": round(r["rate"] / max(base["rate"], 1e-9), 2),
             "target": "—", "met": None} for r in results]


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
