"""A finished rollout on a time axis, for the trajectory page's waterfall: its stages and its turns.

Called by `ui/app.py` with the trajectory (wire form). From `timings` (seconds per stage, `stamps`: when each stage
began on its node) and `metrics.node_wait_init_seconds` (the lease waiting on its node for an INIT slot): the
controller's queue, the node's wait, then INIT, RUN and EVAL, each bar as long as its `timings` entry, a `wait`
bar wherever a stage began after the one before ended (waiting for a pool slot). Within RUN, from each turn's
`started`, `modelSeconds` and `toolSeconds`: its model call and its tool calls; the rest of RUN is other work.
Times are seconds from the rollout's queueing. Next step: the model calls of a harness's segments.
"""
from __future__ import annotations

from typing import Any

from ..work.feed import real_fact

STAGES = ("init", "run", "eval")


def _bar(kind: str, label: str, start: float, seconds: float) -> dict[str, Any]:
    return {"kind": kind, "label": label, "start": round(start, 6), "seconds": round(max(seconds, 0.0), 6)}


def _turns(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    segments = trajectory.get("segments") or []
    return [t for s in segments for t in s.get("turns") or []] if segments else trajectory.get("turns") or []


def _held(timings: dict[str, Any], stamps: dict[str, Any], turns: list[dict[str, Any]], node_wait: Any) -> bool:
    """Every time the waterfall adds up is one a sum can take (`feed.real_fact`): a node's two stages of 1e308 s
    made the total infinite, which the page's JSON cannot hold (a 500)."""
    times = [node_wait, *stamps.values(), *(timings.get(stage) for stage in ("queue", *STAGES)),
             *(turn.get(k) for turn in turns for k in ("started", "modelSeconds", "toolSeconds"))]
    return all(real_fact(x) is not None for x in times if x is not None)


def waterfall(trajectory: dict[str, Any]) -> dict[str, Any] | None:
    """`{bars, total, split}`, or None for a rollout without stamps (it never reached INIT) or with a time no sum
    can take."""
    timings = trajectory.get("timings") or {}
    stamps = timings.get("stamps") or {}
    if "init" not in stamps or not _held(timings, stamps, _turns(trajectory),
                                         (trajectory.get("metrics") or {}).get("node_wait_init_seconds")):
        return None
    queue = float(timings.get("queue") or 0.0)
    node_wait = float((trajectory.get("metrics") or {}).get("node_wait_init_seconds") or 0.0)
    origin = stamps["init"] - node_wait - queue
    bars = [_bar("queue", "queue", 0.0, queue)]
    if node_wait > 0:
        bars.append(_bar("wait", "wait for an init slot", queue, node_wait))
    end = stamps["init"]
    for stage in STAGES:
        if stage not in stamps:
            continue
        if stamps[stage] - end > 0:
            bars.append(_bar("wait", f"wait for a {stage} slot", end - origin, stamps[stage] - end))
        seconds = float(timings.get(stage) or 0.0)
        bars.append(_bar("stage", stage, stamps[stage] - origin, seconds))
        end = stamps[stage] + seconds
    model = tool = 0.0
    for n, turn in enumerate(_turns(trajectory)):
        if turn.get("started") is None:
            continue
        m, t = float(turn.get("modelSeconds") or 0.0), float(turn.get("toolSeconds") or 0.0)
        bars.append(_bar("model", f"turn {n + 1}: model", turn["started"] - origin, m))
        if t:
            bars.append(_bar("tool", f"turn {n + 1}: tools", turn["started"] + m - origin, t))
        model, tool = model + m, tool + t
    run = float(timings.get("run") or 0.0)
    split = {"queue": queue, "init": float(timings.get("init") or 0.0), "model": model, "tool": tool,
             "otherRun": max(run - model - tool, 0.0), "eval": float(timings.get("eval") or 0.0)}
    total = max(stamps.get("end", end), end) - origin
    return {"bars": bars, "total": round(total, 6), "split": {k: round(v, 6) for k, v in split.items()}}
