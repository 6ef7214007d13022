"""A batch's samples as a table, and its rollout numbers, for the trackers trainers already use (W&B, MLflow).

Called from the trainer process after `next_batch` (`examples/train_grpo.py --track wandb|mlflow`); what comes
next is the tracker's own UI. wandb and mlflow are imported only inside the call that logs to them.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

from rolloutd.client.batch import Batch, sequences

Decode = Callable[[list[int]], str]

COLUMNS = ("step", "batch", "group", "prompt", "sample", "segment", "reward", "outcome", "failure_reason",
           "policy_versions", "turns", "prompt_tokens", "response_tokens", "queue_s", "init_s", "run_s", "eval_s",
           "backend", "node", "prompt_text", "response_text")


def outcome(sample: dict[str, Any]) -> str:
    """One word per sample, the words of the job's status: scored, agent-failed, infra-failed, config-failed,
    cancelled (a sample of a group the server cancelled has no reward and no failure)."""
    kind = (sample.get("failure") or {}).get("kind", "none")
    if kind == "none":
        return "scored" if sample.get("reward") is not None else "cancelled"
    return f"{kind}-failed"


def sample_rows(batch: Batch, step: int, decode: Decode | None = None) -> list[dict[str, Any]]:
    """One row per token sequence of every sample in the batch's groups (a harness that rewrote its history
    leaves several), with the columns of `COLUMNS`. The text columns are filled only when `decode` (the
    trainer's tokenizer's `decode`) is given: the ids are the engine's own, never re-tokenized."""
    rows = []
    for group in batch.groups:
        for s in group.samples:
            timings, failure = s.get("timings") or {}, s.get("failure") or {}
            for j, seq in enumerate(sequences(s)):
                ids, p = list(seq.get("tokenIds") or []), int(seq.get("promptLength") or 0)
                mask = list(seq.get("lossMask") or [])
                rows.append({
                    "step": step, "batch": batch.batch, "group": group.group, "prompt": s.get("prompt", group.prompt),
                    "sample": s.get("sample", 0), "segment": j, "reward": s.get("reward"), "outcome": outcome(s),
                    "failure_reason": failure.get("reason", ""),
                    "policy_versions": ",".join(str(v) for v in (s.get("policyVersions") or [])),
                    "turns": len(seq.get("turns") or []), "prompt_tokens": p, "response_tokens": sum(mask),
                    "queue_s": timings.get("queue", 0.0), "init_s": timings.get("init", 0.0),
                    "run_s": timings.get("run", 0.0), "eval_s": timings.get("eval", 0.0),
                    "backend": s.get("backend") or "", "node": s.get("node") or "",
                    "prompt_text": decode(ids[:p]) if decode else "",
                    "response_text": decode(ids[p:]) if decode else ""})
    return rows


def step_metrics(batch: Batch) -> dict[str, float]:
    """The batch's rollout numbers under `rollout/`: counts per outcome, the reward mean over the samples that
    carry a reward (scored and agent-failed: what `Batch.to_arrays` trains on), response tokens and turns per
    sample, groups without reward variance, and the server's own counters for the batch."""
    samples = batch.trajectories
    counts = {k: 0 for k in ("scored", "agent-failed", "infra-failed", "config-failed", "cancelled")}
    for s in samples:
        counts[outcome(s)] = counts.get(outcome(s), 0) + 1
    rewards = [float(s["reward"]) for s in samples if s.get("reward") is not None]
    tokens = [sum(sum(seq.get("lossMask") or []) for seq in sequences(s)) for s in samples]
    turns = [sum(len(seq.get("turns") or []) for seq in sequences(s)) for s in samples]
    flat = [g for g in batch.groups if len({r for r in g.rewards if r is not None}) == 1]
    out = {f"rollout/{k.replace('-', '_')}": float(n) for k, n in counts.items()}
    out.update({
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "rollout/response_tokens_mean": statistics.fmean(tokens) if tokens else 0.0,
        "rollout/turns_mean": statistics.fmean(turns) if turns else 0.0,
        "rollout/zero_variance_groups": float(len(flat)),
        "rollout/groups": float(len(batch.groups)),
        "rollout/cancelled_rollouts": float(batch.cancelled_rollouts),
        "rollout/opened_groups": float(batch.opened_groups)})
    if batch.seconds_to_fill is not None:
        out["rollout/seconds_to_fill"] = float(batch.seconds_to_fill)
    return out


def log_wandb(batch: Batch, step: int, *, decode: Decode | None = None, run: Any = None,
              key: str = "rollouts") -> None:
    """The batch's rows as a `wandb.Table` under `key` and its `step_metrics`, at `step` of `run` (default: the
    active run, `wandb.run`). Offline runs (`WANDB_MODE=offline`) write the same table to their local files."""
    import wandb

    run = run or wandb.run
    if run is None:
        raise RuntimeError("log_wandb needs a run: call wandb.init() first or pass run=")
    rows = sample_rows(batch, step, decode)
    table = wandb.Table(columns=list(COLUMNS), data=[[r[c] for c in COLUMNS] for r in rows])
    run.log({key: table, **step_metrics(batch)}, step=step)


def log_mlflow(batch: Batch, step: int, *, decode: Decode | None = None, key: str = "rollouts") -> None:
    """The batch's rows as an MLflow table artifact `key/step_<step>.json` (shown in the run's Evaluation view,
    read back with `mlflow.load_table`) and its `step_metrics` at `step`, in the active run."""
    import mlflow

    if mlflow.active_run() is None:
        raise RuntimeError("log_mlflow needs an active run: call mlflow.start_run() first")
    rows = sample_rows(batch, step, decode)
    mlflow.log_table(data={c: [r[c] for r in rows] for c in COLUMNS}, artifact_file=f"{key}/step_{step:06d}.json")
    mlflow.log_metrics({k: v for k, v in step_metrics(batch).items() if v == v}, step=step)  # no NaN in MLflow
