"""rolloutd's trainer client (installed as `rolloutd.client`): submit RolloutJobs, stream
trajectories and groups, take batches, announce policy versions, manage LLM backends.

    from rolloutd.client import RolloutClient          # or AsyncRolloutClient
    with RolloutClient() as rc:
        rc.apply("job.yaml")
        batch = rc.next_batch("my-job")
        arrays = batch.to_arrays(pad_id=0)            # lists ready for torch.tensor(...)
        rc.announce_policy("my-job", version=1, weights_path="/ckpt/step-1")

Imports only httpx and the standard library (PyYAML lazily, for YAML files) besides rolloutd's
import-light modules, so it installs in a trainer's environment without the controller's dependencies
being imported. Modules: `connection` (server and token), `errors`, `calls` (one request each),
`core` (the loops' state: streams with retry, waits, long-polls), `sync`, `aio`, `batch` (`Batch.to_arrays`).
"""
from .batch import Batch, Group, grpo_advantages, sequences
from .calls import load_job
from .connection import Connection, resolve
from .errors import (
    BadRequest, Conflict, ConnectionFailed, Gone, Invalid, JobEnded, NotFound, RolloutdError, Unauthorized, WaitTimeout,
)
from .sync import RolloutClient


def __getattr__(name: str):
    """`AsyncRolloutClient` on first use: asyncio costs a command-line call (`rolloutctl get`) ~20 ms it never needs."""
    if name == "AsyncRolloutClient":
        from .aio import AsyncRolloutClient

        return AsyncRolloutClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "AsyncRolloutClient", "BadRequest", "Batch", "Conflict", "Connection", "ConnectionFailed", "Gone", "Group",
    "Invalid", "JobEnded", "NotFound", "RolloutClient", "RolloutdError", "Unauthorized", "WaitTimeout",
    "grpo_advantages", "load_job", "resolve", "sequences",
]
