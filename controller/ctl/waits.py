"""`rolloutctl wait`'s and `delete --wait`'s waits: a condition, a phase or the job's deletion, as an exit code.
Called by `app.py` (`wait`, `delete --wait` and `--purge`); the trainer client's wait and watch follow the job.

Exit codes: 0 met, 1 never will be (the job ended otherwise), 3 timed out; what it says goes to `err` (app.py's
stderr console), the line of a met condition to stdout.
"""
from __future__ import annotations

from rich.console import Console

from rolloutd.client import JobEnded, NotFound, RolloutClient, WaitTimeout


def wait_for(client: RolloutClient, name: str, want: str, timeout: float, err: Console) -> int:
    """`--for=condition=TYPE[=VALUE]`, `phase=PHASE` or `delete` → exit code: 0 met, 1 never will be, 3 timed out."""
    if want == "delete":
        return wait_deleted(client, name, timeout, err)
    kind, _, arg = want.partition("=")
    try:
        client.wait(name, arg if kind == "condition" else want, timeout)
    except JobEnded as e:
        err.print(f"error: {e}")
        return 1
    except WaitTimeout:
        err.print(f"error: timed out after {timeout:g}s waiting for {want} on rolloutjob/{name}")
        return 3
    print(f"rolloutjob.rolloutd.io/{name} {kind} met")
    return 0


def wait_deleted(client: RolloutClient, name: str, timeout: float, err: Console) -> int:
    try:
        obj = client.get(name)
    except NotFound:
        return 0
    for type_, _obj, _rv in client.watch(name=name, since=obj["metadata"]["resourceVersion"], timeout=timeout):
        if type_ == "DELETED":
            print(f"rolloutjob.rolloutd.io/{name} deleted")
            return 0
    err.print(f"error: timed out after {timeout:g}s waiting for delete on rolloutjob/{name}")
    return 3
