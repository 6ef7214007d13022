"""Task handlers: how a dataset row becomes an agent rollout and a reward.

Sits in the node daemon (`rolloutd.agents`): the INIT/RUN/EVAL pipeline calls
`get_handler(spec.tasks.kind)` once per job, then `handler.load(...)` for the rows and
`init` / `run` / `eval` per rollout. Built-ins (math, stem, code, swe) and third-party
plug-ins are found the same way, through the `rolloutd.tasks` entry-point group.
"""
from .base import (
    DatasetError,
    EvalError,
    HandlerScope,
    Reward,
    TaskHandler,
)
from .registry import UnknownTaskKind, get_handler, known_kinds

__all__ = [
    "DatasetError",
    "EvalError",
    "HandlerScope",
    "Reward",
    "TaskHandler",
    "UnknownTaskKind",
    "get_handler",
    "known_kinds",
]
