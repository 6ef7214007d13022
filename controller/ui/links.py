"""One click from a rollout to its trace and to its node's log lines: the links the in-flight view and the rollout
page carry, and the log lines of one attempt.

Called by `ui/app.py`. The trace link is ROLLOUTD_TRACE_URL (`crds/kit/settings.py`, e.g. Jaeger's
`http://jaeger:16686/trace/{trace_id}`) with the attempt's trace id: in flight from its open root span
(`work/tracing.trace_id`), finished from the trajectory (`Trajectory.trace_id`, set by the controller). The log lines
come from the job's executor (`executors/*.logs`, as `rolloutctl logs`), the node's file only (its slot in the
node registry), kept when they name the attempt id or its trace id (the daemon logs both when the attempt starts,
and `crds/tracing.TraceIdFilter` stamps every line inside its span with the trace id).
Next step: a time window around the attempt for lines that name neither.
"""
from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

from ..executors.logs import TAIL_MAX

TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
LINES_MAX = 2000  # the attempt's lines returned, the newest


def trace_url(template: str | None, trace_id: str | None) -> str | None:
    """The template with `{trace_id}` filled (only a well-formed id: nothing of it becomes markup or a scheme)."""
    if not template or not trace_id or not TRACE_ID.match(trace_id):
        return None
    return template.replace("{trace_id}", trace_id)


def logs_page(namespace: str, name: str, node: str | None, attempt: str | None, trace_id: str | None) -> str | None:
    """The UI page of one attempt's log lines on its node (None when the node is unknown)."""
    if not node:
        return None
    q = f"?node={quote(str(node), safe='')}"
    if attempt:
        q += f"&attempt={quote(attempt, safe='')}"
    if trace_id and TRACE_ID.match(trace_id):
        q += f"&trace={trace_id}"
    return f"/ui/jobs/{quote(namespace, safe='')}/{quote(name, safe='')}/logs{q}"


def slot_of(listing: list[tuple], node: str) -> int | None:
    """The slot (the executor's node K) of the node whose id or name is `node` (`Scheduler.node_listing` rows)."""
    for node_id, node_name, _host, _state, slot, _seen in listing:
        if node in (node_id, node_name):
            return slot
    return None


async def attempt_lines(executor: Any, job: Any, slot: int, needles: list[str]) -> dict[str, Any]:
    """The node's log lines (of its last TAIL_MAX) that hold any of `needles`, the newest LINES_MAX of them."""
    chunks = await executor.logs(job, slot, TAIL_MAX, False)
    lines: list[str] = []
    seen = 0
    try:
        async for chunk in chunks:
            for line in chunk.splitlines():
                seen += 1
                if not needles or any(n in line for n in needles):
                    lines.append(line)
    finally:
        await chunks.aclose()
    return {"lines": lines[-LINES_MAX:], "matched": len(lines), "read": seen, "needles": needles}
