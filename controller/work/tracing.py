"""The controller's part of a rollout attempt's trace: its root span (queued → result) and its `queue` span.

`attempts.Attempts.lease_now` calls `granted` for every lease it grants (the answer carries the traceparent the node
daemon continues, agents/spans.py); `ended` closes the root span when the attempt's result is taken or
dropped, or its lease expires. A no-op unless tracing is on (crds/kit/tracing.py). Ids are span attributes only.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from rolloutd.crds.kit import tracing

MOST_OPEN = 100_000   # attempts whose root span is open; past this the oldest is ended as "unknown"

_open: OrderedDict[str, Any] = OrderedDict()


def granted(lease: Any, job_key: str, node: str) -> str | None:
    """Open the attempt's root span (from when it was queued) with its `queue` span ended now; the traceparent
    for the lease answer (None with tracing off)."""
    if not tracing.enabled():
        return None
    attempt_id, item, queued_seconds = lease.attempt_id, lease.item, lease.queued_seconds
    namespace, _, name = job_key.rpartition("/")
    now = time.time_ns()
    start = now - int(max(queued_seconds, 0.0) * 1e9)
    attrs = {"rolloutd.attempt.id": attempt_id, "rolloutd.rollout.id": f"{job_key}#{item}",
             "rolloutd.job": name, "rolloutd.namespace": namespace or "default", "rolloutd.item": item,
             "rolloutd.prompt": lease.prompt, "rolloutd.sample": lease.sample, "rolloutd.attempt": lease.attempt,
             "rolloutd.node": node, "rolloutd.backend": lease.backend}
    root = tracing.start("rollout", attrs, start_time=start)
    queue = tracing.start("queue", {"rolloutd.attempt.id": attempt_id, "rolloutd.queue.seconds": queued_seconds},
                          start_time=start, parent=root)
    queue.end(end_time=now)
    _open[attempt_id] = root
    while len(_open) > MOST_OPEN:
        _, old = _open.popitem(last=False)
        tracing.set_attributes(old, {"rolloutd.outcome": "unknown"})
        old.end()
    return tracing.traceparent(root)


def trace_id(attempt_id: str) -> str | None:
    """The trace id (32 hex digits) of an attempt whose root span is open (None with tracing off, or once ended)."""
    root = _open.get(attempt_id) if _open else None
    if root is None:
        return None
    ctx = root.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def ids(attempt_id: str) -> dict[str, str | None]:
    """What a trajectory records of its attempt (`Trajectory.attempt_id`, `.trace_id`): its node's log lines and its
    trace are found by them (the web UI's links, `controller/ui/links.py`)."""
    return {"attempt_id": attempt_id, "trace_id": trace_id(attempt_id)}


def ended(attempt_id: str, outcome: str, trajectory: Any = None) -> None:
    """Close the attempt's root span: `outcome` (done, queued again, failed, dropped, expired), the reward and
    failure of its `trajectory` when one came; an error when it expired or failed for a reason not the policy's."""
    root = _open.pop(attempt_id, None) if _open else None
    if root is None:
        return
    attrs: dict[str, Any] = {"rolloutd.outcome": outcome}
    failed = "lease expired" if outcome == "expired" else None
    if trajectory is not None:
        kind = str(getattr(trajectory.failure.kind, "value", ""))
        attrs.update({"rolloutd.reward": trajectory.reward, "rolloutd.failure.kind": kind,
                      "rolloutd.finish_reason": trajectory.finish_reason})
        if kind in ("infra", "config"):
            failed = trajectory.failure.reason or kind
    tracing.set_attributes(root, attrs)
    if failed:
        tracing.error(root, failed)
    root.end()
