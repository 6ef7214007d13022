"""Weight sync and the trainer-vs-vLLM check for TRL: after each optimizer step the new weights reach
rolloutd's backends before the next rollouts, and each step logs how far TRL's logprobs are from vLLM's.

Where it sits: `PolicySync` is a transformers `TrainerCallback` given to `GRPOTrainer(callbacks=…)`;
`LogprobGap.attach(trainer)` wraps two of the trainer's methods to read its training-pass logprobs.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rolloutd.client import RolloutClient

from ..weights import save_weights


class PolicySync(TrainerCallback):
    """At the start of training, and on every optimizer step's end: save the policy to `weights_dir/v<global_step>` and
    `announce_policy(job, version=global_step, weights_path=…)`: rolloutd holds new LLM calls,
    drains, has every backend reload the file, resets prefix caches and tags later trajectories
    with the version, which `RolloutSource` then checks against TRL's `global_step`.
    Raises if a backend did not reload. Keeps only the newest `keep` versions on disk."""

    def __init__(self, client: RolloutClient, job: str, weights_dir: str | Path, *, keep: int = 1,
                 timeout: float = 600.0):
        self.client, self.job, self.weights_dir = client, job, Path(weights_dir)
        self.keep, self.timeout = keep, timeout
        self.history: list[dict[str, Any]] = []  # one entry per optimizer step
        self.initial: dict[str, Any] | None = None  # the weights TRL started from (version 0)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # the backends may serve other weights than TRL starts from (an earlier run's, a reloaded
        # checkpoint): publish TRL's own before the first rollouts, or version tags would lie
        self.initial = self._publish(model, int(state.global_step))
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.history.append(self._publish(model, int(state.global_step)))
        return control

    def _publish(self, model, version: int) -> dict[str, Any]:
        t0 = time.monotonic()
        path = save_weights(model, self.weights_dir / f"v{version}")
        t1 = time.monotonic()
        applied = self.client.announce_policy(self.job, version, weights_path=path, pause=True, timeout=self.timeout)
        backends = applied.get("backends", [])
        failed = [b for b in backends if not b.get("reloaded")]
        if failed:
            raise RuntimeError(f"version {version} was not reloaded by {failed} (rolloutjob {self.job})")
        shutil.rmtree(self.weights_dir / f"v{version - self.keep}", ignore_errors=True)
        return {"version": version, "save_s": t1 - t0, "sync_s": time.monotonic() - t0,
                "paused_s": float(applied.get("pausedSeconds") or 0.0), "reloaded": bool(backends)}


class LogprobGap:
    """Per optimizer step: the max |TRL logprob − vLLM logprob| over trained tokens.

    With `use_vllm=False` and one optimizer step per generation TRL treats the rollouts as
    on-policy (its importance ratio is 1 by construction), so this is the check that rolloutd's
    ids and logprobs are the ones TRL's model scores: fp32 both, it stays ~1e-5; one shifted id
    or stale weights make it large. Read `steps` (one value per step, oldest first)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._current = 0.0
        self._last_logps = None

    @classmethod
    def attach(cls, trainer: Any) -> "LogprobGap":
        import torch

        gap = cls()
        score, loss = trainer._get_per_token_logps_and_entropies, trainer._compute_loss

        def scored(*a, **kw):
            out = score(*a, **kw)
            if kw.get("compute_entropy"):  # the training pass (the no-grad passes do not ask for entropies)
                gap._last_logps = out[0].detach()
            return out

        def computed(model, inputs):
            result = loss(model, inputs)
            sampled, logps = inputs.get("sampling_per_token_logps"), gap._last_logps
            if sampled is not None and logps is not None:
                mask = inputs["completion_mask"] * inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
                diff = (logps - sampled).abs()[mask.bool()]
                if diff.numel():
                    gap._current = max(gap._current, float(diff.max()))
            return result

        trainer._get_per_token_logps_and_entropies, trainer._compute_loss = scored, computed
        trainer.add_callback(_GapStep(gap))
        return gap


class _GapStep(TrainerCallback):
    def __init__(self, gap: LogprobGap):
        self.gap = gap

    def on_step_end(self, args, state, control, **kwargs):
        self.gap.steps.append(self.gap._current)
        self.gap._current = 0.0
        return control
