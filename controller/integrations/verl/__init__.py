"""verl trains through rolloutd: `RolloutdAgentLoop` (agent name "rolloutd") runs each dataset row as one rollout
of its group on a rolloutd batch job; `RolloutdCheckpointManager` keeps the job on verl's rollout servers and
tags rollouts with verl's step after each weight sync (`follow_servers` / `announce_weights` underneath).

    pip install 'rolloutd[verl]'     # verl + torch, in the trainer's own venv (`make verl-venv`)

See docs "Training with verl" and examples/verl/. `servers.py` and `dataset.py` need no verl;
`agent_loop.py` and `checkpoint.py` do.
"""
from __future__ import annotations

from typing import Any

from .dataset import to_verl_rows
from .servers import announce_weights, follow_servers

__all__ = ["RolloutdAgentLoop", "RolloutdCheckpointManager", "announce_weights", "follow_servers", "to_output",
           "to_verl_rows"]


def __getattr__(name: str) -> Any:  # verl (torch, ray) only when the agent loop is asked for
    if name in ("RolloutdAgentLoop", "to_output"):
        from . import agent_loop

        return getattr(agent_loop, name)
    if name == "RolloutdCheckpointManager":
        from .checkpoint import RolloutdCheckpointManager

        return RolloutdCheckpointManager
    raise AttributeError(name)
