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
# Each name is imported from its module on first use, so that `rolloutctl get` (controller/ctl/fast.py) can read
# `connection` without importing httpx and the client's loops.
_WHERE = {
    "Batch": "batch", "Group": "batch", "grpo_advantages": "batch", "sequences": "batch", "load_job": "calls",
    "Connection": "connection", "resolve": "connection", "RolloutClient": "sync", "AsyncRolloutClient": "aio",
    **{n: "errors" for n in ("BadRequest", "ClientError", "Conflict", "ConnectionFailed", "Gone", "Invalid", "JobEnded",
                             "NotFound", "RolloutdError", "Unauthorized", "WaitTimeout")},
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AsyncRolloutClient", "BadRequest", "Batch", "ClientError", "Conflict", "Connection", "ConnectionFailed", "Gone",
    "Group",
    "Invalid", "JobEnded", "NotFound", "RolloutClient", "RolloutdError", "Unauthorized", "WaitTimeout",
    "grpo_advantages", "load_job", "resolve", "sequences",
]
