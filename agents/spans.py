"""The node daemon's part of a rollout attempt's trace: the attempt's node span (under the controller's root, from
the lease's traceparent), its stages, and its model calls with the GenAI semantic conventions.

`daemon.pipeline.Pipeline` opens `attempt` and `stage`, `daemon.llmgate.TrackedLLM` wraps each model call in
`model_call`, agents/loop/run.py spans its turns and tool calls. All no-ops unless tracing is on (crds/kit/tracing.py;
the spans themselves: crds/kit/trace_spans.py).
"""
from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

from rolloutd.crds.kit import trace_spans, tracing

_EXIT = re.compile(r"\[exit code (-?\d+)\]\s*$")


@contextlib.contextmanager
def attempt(r: Any, job_key: str, node: str, log: Any) -> Iterator[Any]:
    """The attempt's span on this node, child of the controller's root span (the lease's traceparent); its ids
    logged once, next to the trace id (`tracing.TraceIdFilter`); with tracing off, the ids alone."""
    lease = r.lease
    if not tracing.enabled():  # the line the web UI's log view finds the attempt by (`controller/ui/links.py`)
        log.info("rollout %s: job %s, item %d (prompt %d, sample %d), attempt %d", lease.attempt_id, job_key,
                 lease.item, lease.prompt, lease.sample, lease.attempt)
        yield trace_spans.NOTHING
        return
    namespace, _, name = job_key.rpartition("/")
    attrs = {"rolloutd.attempt.id": lease.attempt_id, "rolloutd.rollout.id": f"{job_key}#{lease.item}",
             "rolloutd.job": name, "rolloutd.namespace": namespace or "default", "rolloutd.item": lease.item,
             "rolloutd.prompt": lease.prompt, "rolloutd.sample": lease.sample, "rolloutd.attempt": lease.attempt,
             "rolloutd.node": node, "rolloutd.backend": lease.backend}
    with trace_spans.span("node.attempt", attrs, parent=lease.traceparent) as s:
        log.info("rollout %s: job %s, item %d (prompt %d, sample %d), attempt %d, trace_id=%s", lease.attempt_id,
                 job_key, lease.item, lease.prompt, lease.sample, lease.attempt, tracing.trace_id())
        yield s


def outcome(s: Any, t: Any) -> None:
    """What the attempt came to on the node: reward, failure kind and reason (an error unless scored)."""
    kind = str(getattr(t.failure.kind, "value", t.failure.kind))
    trace_spans.set_attributes(s, {"rolloutd.reward": t.reward, "rolloutd.failure.kind": kind,
                               "rolloutd.finish_reason": t.finish_reason,
                               "rolloutd.turns": len(t.turns)})
    if kind in ("infra", "config"):
        trace_spans.error(s, t.failure.reason or kind)


def stage(name: str, attempt_id: str, waited: float) -> Any:
    """One stage (INIT, RUN, EVAL) once its pool slot is held (a `with` block); `waited`: seconds spent waiting for
    the slot."""
    if not tracing.enabled():
        return trace_spans.OFF
    return trace_spans.span(name, {"rolloutd.attempt.id": attempt_id, "rolloutd.stage": name.lower(),
                               "rolloutd.stage.wait_seconds": round(waited, 6)})


@contextlib.contextmanager
def model_call(inner: Any, prompt_ids: list[int], sampling: Any, request_id: str,
               version: Any) -> Iterator[Any]:
    """One generation on the pinned backend (GenAI conventions: `text_completion {model}`); the caller sets the
    result with `generated`."""
    if not tracing.enabled():
        yield trace_spans.NOTHING
        return
    model = getattr(inner, "model", None)
    model = model if isinstance(model, str) else None
    attrs = {"gen_ai.operation.name": "text_completion", "gen_ai.system": "vllm",
             "gen_ai.request.model": model, "gen_ai.request.max_tokens": getattr(sampling, "max_tokens", None),
             "gen_ai.request.temperature": getattr(sampling, "temperature", None),
             "gen_ai.request.seed": getattr(sampling, "seed", None),
             "gen_ai.usage.input_tokens": len(prompt_ids), "rolloutd.request.id": request_id,
             "rolloutd.backend": getattr(inner, "url", None), "rolloutd.policy.version": version}
    with trace_spans.span(f"text_completion {model or 'policy'}", attrs) as s:
        yield s
        if model is None and isinstance(getattr(inner, "model", None), str):   # discovered by the first call
            trace_spans.set_attributes(s, {"gen_ai.request.model": inner.model})


def generated(s: Any, gen: Any, started: float) -> None:
    """A model call's outcome on its span: output tokens, finish reason, cached prompt tokens, time to first
    token (GenAI semantic conventions), duration."""
    trace_spans.set_attributes(s, {"gen_ai.usage.output_tokens": len(gen.token_ids),
                               "gen_ai.response.finish_reasons": [gen.finish_reason],
                               "rolloutd.usage.cached_tokens": gen.cached_tokens,
                               "gen_ai.server.time_to_first_token": getattr(gen, "first_token_seconds", None),
                               "rolloutd.duration_seconds": round(time.monotonic() - started, 6)})


def tool_call(name: str) -> Any:
    """One tool call in the sandbox (a `with` block; GenAI conventions: `execute_tool {name}`); the caller sets
    `tool_result`."""
    if not tracing.enabled():
        return trace_spans.OFF
    return trace_spans.span(f"execute_tool {name}", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name})


def tool_result(s: Any, result: Any, started: float) -> None:
    """A tool call's outcome on its span: ok, its exit status (bash), whether it submitted, duration."""
    m = _EXIT.search(result.observation[-40:]) if isinstance(result.observation, str) else None
    trace_spans.set_attributes(s, {"rolloutd.tool.ok": result.ok, "rolloutd.tool.exit_code": int(m.group(1)) if m else None, "rolloutd.tool.submitted": result.submitted is not None,
                               "rolloutd.duration_seconds": round(time.monotonic() - started, 6)})
