"""The controller's part of a rollout attempt's trace: its root span (queued → result) and its `queue` span.

`attempts.Attempts.lease_now` calls `granted` for every lease it grants (the answer carries the traceparent the node
daemon continues, agents/spans.py); `ended` closes the root span when the attempt's result is taken or
dropped, or its lease expires. A no-op unless tracing is on (crds/kit/tracing.py). Ids are span attributes only.
Cost: a grant keeps the ids and a few plain values (~2 µs); both spans are encoded when the attempt ends (~10 µs:
one %-format each, `otlp.template`, the attributes it shares with other attempts encoded once; in a busy process
~2× that, `bench tracing_hooks`) and sent in batches by crds/kit/otlp.py
(`bench tracing_scale`: the SDK's spans cost a controller at 1000 nodes ~40 % more CPU per rollout). A graceful stop
ends the attempts in flight (`stopped`).
"""
from __future__ import annotations

import logging
import random
import struct
import time
from typing import Any, Mapping

from rolloutd.crds.kit import otlp, tracing
from rolloutd.crds.kit.otlp import Finished

log = logging.getLogger("rolloutd.tracing")
MOST_OPEN = 100_000   # attempts whose root span is open; past this the oldest is ended as "unknown"
STOPPED = "controller stopped"   # the outcome of an attempt still in flight when its controller stopped

# attempt id → (trace id, span id, queued at, granted at (ns), job key, node, item, prompt, sample, attempt, backend,
# seconds queued, traceparent): what its two spans are built from when it ends (a dict keeps the order of grants)
_open: dict[str, tuple] = {}
# the attributes an attempt shares with many others, encoded once: (job, node, backend) and its ending's
_shared: dict[tuple, bytes] = {}
_fixed64 = struct.Struct("<Q").pack   # a span's times
# the two spans' %-formats (`otlp.template`), and the status of a span that did not fail
_QUEUE, _ROOT, _OK = otlp.template("queue", True), otlp.template("rollout", False), otlp.status(None)


def granted(grant: Mapping[str, Any], job_key: str, node: str) -> str | None:
    """Open the attempt's root span (from when it was queued; its `queue` span ends now): the traceparent for the
    lease answer (None with tracing off; not sampled, by `OTEL_TRACES_SAMPLER`: a traceparent saying so, nothing kept).
    `grant`: the `Lease`'s fields before it is made (attempt_id, item, prompt, sample, attempt, backend,
    queued_seconds), so that the traceparent goes to its constructor: assigned to a made one, pydantic validates the
    assignment (~3 µs a lease, tracing off too)."""
    if not tracing.enabled():
        return None
    trace_id, span_id = tracing.new_ids()
    if not tracing.sampled(trace_id, "rollout"):
        return tracing.traceparent_of(trace_id, span_id, False)
    now = time.time_ns()
    queued = grant["queued_seconds"]
    tp = tracing.traceparent_of(trace_id, span_id)
    _open[grant["attempt_id"]] = (trace_id, span_id, now - int(max(queued, 0.0) * 1e9), now, job_key, node,
                                  grant["item"], grant["prompt"], grant["sample"], grant["attempt"], grant["backend"],
                                  queued, tp)
    if len(_open) > MOST_OPEN:
        while len(_open) > MOST_OPEN:
            oldest = next(iter(_open))
            _end(oldest, _open.pop(oldest), "unknown", None)
    return tp


def trace_id(attempt_id: str) -> str | None:
    """The trace id (32 hex digits) of an attempt whose root span is open (None with tracing off, or once ended)."""
    rec = _open.get(attempt_id) if _open else None
    return rec[12][3:35] if rec is not None else None


def ids(attempt_id: str) -> dict[str, str | None]:
    """What a trajectory records of its attempt (`Trajectory.attempt_id`, `.trace_id`): its node's log lines and its
    trace are found by them (the web UI's links, `controller/ui/links.py`)."""
    return {"attempt_id": attempt_id, "trace_id": trace_id(attempt_id)}


def ended(attempt_id: str, outcome: str, trajectory: Any = None) -> None:
    """Close the attempt's root span: `outcome` (done, queued again, failed, dropped, expired), the reward and
    failure of its `trajectory` when one came; an error when it expired or failed for a reason not the policy's."""
    rec = _open.pop(attempt_id, None) if _open else None
    if rec is not None:
        _end(attempt_id, rec, outcome, trajectory)


def stopped() -> int:
    """A graceful stop, once no result can come any more (the server closed): the attempts still in flight get their
    root span ended now, outcome `controller stopped` (not an error: the rollout did not fail), and every span ended
    is sent before the process exits; how many were in flight. Not left for the next controller to end: it would not
    know them (their ids are kept in memory only), and the daemons' spans would be left without their root."""
    if not tracing.enabled():
        return 0
    tracing.stopping()
    n = len(_open)
    for attempt_id in list(_open):
        _end(attempt_id, _open.pop(attempt_id), STOPPED, None)
    tracing.flush()
    log.log(logging.WARNING if tracing.lost() else logging.INFO, "tracing: %d attempts in flight ended as %r; %s",
            n, STOPPED, tracing.counts())
    return n


def _end(attempt_id: str, rec: tuple, outcome: str, trajectory: Any) -> None:
    """Send the attempt's `queue` and root spans, built now: encoded here (`otlp.template`'s formats, the attributes
    shared with other attempts encoded once), or as `Finished` spans when they go through a provider (`tracing.use`)."""
    trace_id, span_id, start, granted_at, job_key, node, item, prompt, sample, attempt, backend, queued, _ = rec
    failed = "lease expired" if outcome == "expired" else None
    reward = kind = finish = None
    if trajectory is not None:
        kind = str(getattr(trajectory.failure.kind, "value", ""))
        reward, finish = trajectory.reward, trajectory.finish_reason
        if kind in ("infra", "config"):
            failed = (trajectory.failure.reason or kind)[:500]
    where, ending = (job_key, node, backend), (outcome, type(reward), reward, kind, finish)
    shared_where, shared_ending = _shared.get(where), _shared.get(ending)
    if shared_where is None or shared_ending is None:
        if len(_shared) > 10_000:
            _shared.clear()
        shared_where = _shared[where] = otlp.attributes(_where(*where))
        shared_ending = _shared[ending] = otlp.attributes(_ending(*ending))
    queue_id, now = random.getrandbits(64) or 1, time.time_ns()
    tb, sb, t0 = trace_id.to_bytes(16, "big"), span_id.to_bytes(8, "big"), _fixed64(start)
    first = otlp.fresh((("rolloutd.attempt.id", attempt_id),))
    queue = _QUEUE % (tb, queue_id.to_bytes(8, "big"), sb, t0, _fixed64(granted_at),
                      first + otlp.fresh((("rolloutd.queue.seconds", queued),)), _OK)
    own = otlp.fresh((("rolloutd.rollout.id", f"{job_key}#{item}"), ("rolloutd.item", item),
                      ("rolloutd.prompt", prompt), ("rolloutd.sample", sample), ("rolloutd.attempt", attempt)))
    root = _ROOT % (tb, sb, t0, _fixed64(now), first + own + shared_where + shared_ending,
                    _OK if failed is None else otlp.status(failed))
    if not tracing.encoded(queue, root):
        aid = ("rolloutd.attempt.id", attempt_id)
        tracing.finished(Finished("queue", trace_id, queue_id, span_id, start, granted_at,
                                  dict((aid, ("rolloutd.queue.seconds", queued)))))
        tracing.finished(Finished("rollout", trace_id, span_id, 0, start, now, dict((
            aid, ("rolloutd.rollout.id", f"{job_key}#{item}"), ("rolloutd.item", item), ("rolloutd.prompt", prompt),
            ("rolloutd.sample", sample), ("rolloutd.attempt", attempt), *_where(*where), *_ending(*ending))), failed))


def _where(job_key: str, node: str, backend: str | None) -> tuple:
    namespace, _, name = job_key.rpartition("/")
    return (("rolloutd.job", name), ("rolloutd.namespace", namespace or "default"), ("rolloutd.node", node),
            ("rolloutd.backend", backend))


def _ending(outcome: str, _type: type, reward: Any, kind: str | None, finish: str | None) -> tuple:
    return (("rolloutd.outcome", outcome), ("rolloutd.reward", reward), ("rolloutd.failure.kind", kind),
            ("rolloutd.finish_reason", finish))
