"""The example GRPO trainer (`examples/train_grpo.py`) run asynchronously (`--prefetch`: batch k+1 generates while
batch k trains) with spec.policy.updateMode drain, then keep, on one engine and one controller, same seed and
settings: steps/s, rollouts/s, the trainer's wait at each announce, samples one version behind, the reward per step.

Two settings. `tiny` (default): the random tiny model, 4 groups × 4 samples: the pipeline around an update, no
learning. `smollm2`: SmolLM2-135M-Instruct in fp32 with the setting that learned in FACTS.md (8 prompts × 8
samples, temperature 1.0, ≤ 128 tokens, lr 1e-5), ~20 steps per mode: the reward curves keep vs drain.

The trainer runs in the engine venv (torch) and talks to this tree's controller over HTTP (`--server`), the engine
given by `--engine-url`. Nothing is installed anywhere.

    python -m bench async_grpo [--quick]              tiny → bench/results/RESULTS-async-grpo.md
    ROLLOUTD_ASYNC_GRPO_MODEL=smollm2 python -m bench async_grpo
                                                      → bench/results/RESULTS-async-grpo-smollm2.md
    python -m bench.bench_async_grpo --model smollm2 --steps 20 --seed 0      (the same, with flags)

Settings by env var: ROLLOUTD_ASYNC_GRPO_MODEL (tiny | smollm2), ROLLOUTD_ASYNC_GRPO_STEPS (per mode),
ROLLOUTD_ASYNC_GRPO_SEED (default 0; `--seed` of both runs). A results file's sections from its first `## ` heading
on are notes written by hand: a rerun rewrites the tables above them and keeps them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
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
# per model: the trainer's flags, steps per mode (full, --quick), each mode's time budget (minutes), the results file
SETTINGS = {
    "tiny": {"flags": ["--groups", "4", "--samples", "4", "--max-tokens", "256"], "steps": (6, 3), "minutes": 15,
             "file": "RESULTS-async-grpo.md", "label": "tiny model, 4 groups × 4 samples, ≤ 256 tokens"},
    # FACTS.md, "RL on this CPU": the setting that learned (the trainer samples at temperature 1.0, AdamW betas
    # 0.9/0.99, clip 0.2, fp32, embeddings frozen)
    "smollm2": {"flags": ["--groups", "8", "--samples", "8", "--max-tokens", "128", "--lr", "1e-5"],
                "steps": (20, 2), "minutes": 60, "file": "RESULTS-async-grpo-smollm2.md",
                "label": "SmolLM2-135M-Instruct fp32, 8 prompts × 8 samples, temperature 1.0, ≤ 128 tokens, "
                         "lr 1e-5"},
}


def settings(quick: bool = False, model: str | None = None, steps: int | None = None,
             seed: int | None = None) -> dict:
    """The run's settings: arguments first, then ROLLOUTD_ASYNC_GRPO_* env vars, then the model's defaults."""
    model = model or os.environ.get("ROLLOUTD_ASYNC_GRPO_MODEL") or "tiny"
    if model not in SETTINGS:
        raise SystemExit(f"ROLLOUTD_ASYNC_GRPO_MODEL: {model!r} is not one of {', '.join(SETTINGS)}")
    s = dict(SETTINGS[model], model=model)
    env_steps = os.environ.get("ROLLOUTD_ASYNC_GRPO_STEPS")
    s["steps"] = steps or (int(env_steps) if env_steps else s["steps"][1 if quick else 0])
    s["seed"] = seed if seed is not None else int(os.environ.get("ROLLOUTD_ASYNC_GRPO_SEED") or 0)
    return s


def trainer_command(mode: str, s: dict, engine_url: str, server: str, token: Path, out: Path) -> list[str]:
    """One mode's run of the example trainer: asynchronous (`--prefetch`), this mode, the shared seed."""
    return [str(ENGINE_PY), str(REPO / "examples" / "train_grpo.py"), "--model", s["model"], "--steps",
            str(s["steps"]), *s["flags"], "--seed", str(s["seed"]), "--heldout", "", "--engine-url", engine_url,
            "--server", server, "--token-file", str(token), "--name", f"grpo-{mode}", "--out", str(out),
            "--update-mode", mode, "--prefetch", "--max-minutes", str(s["minutes"])]


def _idle_share(clock: TokenClock, start: float, end: float) -> float:
    idle, prev = 0.0, None
    for t, n in clock.samples:
        if t < start or t > end:
            continue
        if prev is not None and n == prev[1]:
            idle += t - prev[0]
        prev = (t, n)
    return idle / max(end - start, 1e-9)


def _base_weights(engine) -> None:
    """Load the served model's own weights back into the engine (the trainer of the mode before left its trained
    weights there, and a mode's first batch is sampled before its first update) and drop the prefix cache."""
    import httpx

    r = httpx.post(f"{engine.url}/collective_rpc", timeout=600,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(engine.model_dir)}})
    r.raise_for_status()
    httpx.post(f"{engine.url}/reset_prefix_cache", timeout=60).raise_for_status()


def _train(mode: str, s: dict, engine_url: str, server: str, token: Path, out: Path) -> dict:
    env = {**os.environ, "ROLLOUTD_TRAIN_REEXEC": "1"}  # never re-installs: the engine venv imports the client
    subprocess.run(trainer_command(mode, s, engine_url, server, token, out), check=True, env=env, cwd=REPO,
                   timeout=s["minutes"] * 60 + 1800)
    return json.loads((out / "summary.json").read_text())


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(mode: str, summary: dict, idle: float) -> dict:
    """One mode's figures from the trainer's summary.json (its per-step rows)."""
    steps = summary["steps"]
    later = steps[1:]  # the first step has nothing in flight at its announce
    rewards = [r["reward_mean"] for r in steps]
    rollouts = sum(r["samples_scored"] for r in steps)
    seconds = summary["train_seconds"]
    # rates from the end of step 1 on: the first step carries the job's set-up and the engine's first requests
    # (drain runs first, on a cold engine), and has nothing in flight at its announce
    span = (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) or float("nan")
    return {"mode": mode, "steps": len(steps), "seconds": seconds, "rate": len(later) / span,
            "rollouts": rollouts, "rollout_rate": sum(r["samples_scored"] for r in later) / span,
            "sync": _mean([r["sync_s"] for r in later]), "rollout": _mean([r["rollout_s"] for r in later]),
            "idle": idle, "stale": sum(r["stale_samples"] for r in steps), "first": rewards[0],
            "last5": _mean(rewards[-5:]), "best": max(rewards), "rows": steps}


def _f(x: float, fmt: str = ".3f") -> str:
    return "—" if x != x else format(x, fmt)  # NaN: no scored sample that step


def tables(results: list[dict]) -> list[str]:
    """Markdown: the modes side by side, the reward per step side by side, then each mode's steps."""
    lines = ["| mode | steps | steps/s (from step 2) | rollouts/s (from step 2) | "
             "trainer wait at announce (s, mean from step 2) | wait for the batch (s, mean from step 2) | "
             "engine idle share | samples one version behind | reward step 1 | reward, last 5 steps | best reward |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['steps']} | {_f(r['rate'], '.4f')} | {_f(r['rollout_rate'])} | {r['sync']:.2f} | "
              f"{r['rollout']:.2f} | {r['idle']:.0%} | {r['stale']} of {r['rollouts']} | {_f(r['first'])} | "
              f"{_f(r['last5'])} | {_f(r['best'])} |" for r in results]
    n = max(r["steps"] for r in results)
    lines += ["", "Mean reward per step (every scored sample of the batch trained on at that step):", "",
              "| step | " + " | ".join(r["mode"] for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    for i in range(n):
        cells = [_f(r["rows"][i]["reward_mean"]) if i < r["steps"] else "" for r in results]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    for r in results:
        lines += ["", f"### {r['mode']}: per step", "",
                  "| step | reward | informative groups | wait for the batch (s) | train (s) | trainer wait at "
                  "announce (s) | samples one version behind | policy versions in the batch | max abs. logprob "
                  "gap | step (s) | elapsed (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['step']} | {_f(x['reward_mean'])} | {x['groups_informative']}/{x['groups_settled']} | "
                  f"{x['rollout_s']:.1f} | {x['train_s']:.1f} | {x['sync_s']:.2f} | {x['stale_samples']} | "
                  f"{str(x['batch_policy_versions']).replace('|', ', ')} | {x['logprob_diff_max']:.1e} | "
                  f"{x['step_s']:.1f} | {x['elapsed_s']:.0f} |" for x in r["rows"]]
    return lines


def write_results(path: Path, head: list[str], body: list[str]) -> str:
    """Rewrite the generated part of `path`, keeping its hand-written sections (from its first `## ` heading on)."""
    old = path.read_text() if path.exists() else ""
    at = old.find("\n## ")
    notes = old[at + 1:] if at >= 0 else ""
    text = "\n".join(head + body) + "\n" + ("\n" + notes if notes else "")
    path.write_text(text)
    return "\n".join(head + body)


def run(quick: bool = False, model: str | None = None, steps: int | None = None, seed: int | None = None) -> list[dict]:
    from rolloutd.agents.engine.server import EngineServer

    s = settings(quick, model, steps, seed)
    t_begin = time.monotonic()
    engine = EngineServer(s["model"], dtype="float32", max_model_len=2048).start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    print(f"trainer outputs (summary.json, steps.csv per mode) under {tmp}", flush=True)
    ctl, api = start_controller(tmp / "data", _port(), dict(os.environ))
    clock = TokenClock(engine.url)
    results = []
    try:
        reuse = os.environ.get("ROLLOUTD_ASYNC_GRPO_REUSE")  # a folder of an earlier run: its modes not run again
        run_modes = os.environ.get("ROLLOUTD_ASYNC_GRPO_MODES", ",".join(MODES)).split(",")
        for mode in MODES:
            if mode not in run_modes and reuse:
                summary = json.loads((Path(reuse) / mode / "summary.json").read_text())
                results.append(summarize(mode, summary, float("nan")))
                continue
            _base_weights(engine)  # each mode starts from the model as served: not the last mode's trained weights
            start = time.monotonic()
            summary = _train(mode, s, engine.url, str(api.base_url).rstrip("/"), tmp / "data" / "token", tmp / mode)
            results.append(summarize(mode, summary, _idle_share(clock, start, time.monotonic())))
    finally:
        clock.stop()
        os.killpg(ctl.pid, signal.SIGTERM)
        ctl.wait(timeout=60)
        engine.stop()
    env = "" if s["model"] == "tiny" else f"ROLLOUTD_ASYNC_GRPO_MODEL={s['model']} "
    env += f"ROLLOUTD_ASYNC_GRPO_STEPS={s['steps']} " if s["steps"] != SETTINGS[s["model"]]["steps"][quick] else ""
    env += f"ROLLOUTD_ASYNC_GRPO_SEED={s['seed']} " if s["seed"] else ""
    head = ["# Asynchronous GRPO (examples/train_grpo.py --prefetch): drain vs keep", "",
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
            f"{s['label']}, {s['steps']} steps per mode, seed {s['seed']} for both (spec.agent.sampling.seed and the "
            f"trainer's torch seed), one engine and one controller, drain first; whole run "
            f"{(time.monotonic() - t_begin) / 60:.1f} min. "
            f"`{env}python -m bench async_grpo{' --quick' if quick else ''}`.",
            ""]
    print(write_results(HERE / "results" / s["file"], head, tables(results)))
    base = results[0]
    return [{"benchmark": f"async GRPO, {r['mode']} ({r['steps']} steps, {s['model']})",
             "ours": f"{r['rate']:.3f} steps/s (from step 2)", "baseline": f"{base['rate']:.3f} steps/s (drain)",
             "ratio": round(r["rate"] / max(base["rate"], 1e-9), 2), "target": "—", "met": None} for r in results]


if __name__ == "__main__":
    from bench.__main__ import render

    ap = argparse.ArgumentParser(prog="python -m bench.bench_async_grpo")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", choices=tuple(SETTINGS))
    ap.add_argument("--steps", type=int, help="steps per mode")
    ap.add_argument("--seed", type=int, help="--seed of both runs (default 0)")
    a = ap.parse_args()
    print(render(run(quick=a.quick, model=a.model, steps=a.steps, seed=a.seed)))
