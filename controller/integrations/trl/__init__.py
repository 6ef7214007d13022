"""TRL's GRPOTrainer trains through rolloutd: `RolloutSource` (rollout_func + reward), `PolicySync`
(weights to the backends after each step), `LogprobGap` (trainer vs vLLM logprobs per step).

    pip install 'rolloutd[trl]'      # torch + trl, in the trainer's own venv (`make trl-venv`)

See README.md "Training with TRL" and examples/trl/. `rollouts.py` needs no torch; `sync.py` does.
"""
from __future__ import annotations

from typing import Any

from .rollouts import CallStats, RolloutSource, StalePolicy, to_trl

__all__ = ["CallStats", "LogprobGap", "PolicySync", "RolloutSource", "StalePolicy", "to_trl"]


def __getattr__(name: str) -> Any:  # torch/transformers only when the callbacks are asked for
    if name in ("PolicySync", "LogprobGap"):
        from . import sync

        return getattr(sync, name)
    raise AttributeError(name)
