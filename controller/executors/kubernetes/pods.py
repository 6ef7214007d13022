"""The pods of a job's Indexed Job (`executor.py`): what state each node daemon is in and its log.

`node_states` maps the pods to the executor's NodeStates (`observe`); `pod_log_stream` turns an opened pod log
(`read_namespaced_pod_log(..., _preload_content=False)`, a urllib3 response) into whole lines for `logs.merged`,
reading it in a thread. Pure but for that read. Next step: the previous container's log after a restart.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from ..base import NodeState
from ..logs import READ_BYTES

CONTAINER = "node"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def _waiting_reason(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating"):
            return f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason', 'Unschedulable')}: {cond.get('message', '')}".rstrip(": ")
    return ""


def _terminated(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return f"exited with code {term.get('exitCode')}" + (f" ({term['reason']})" if term.get("reason") else "")
    return (pod.get("status") or {}).get("reason") or "failed"


def newest_pods(pods: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Pods of the Job → the newest pod of each completion index."""
    newest: dict[int, dict[str, Any]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(INDEX_ANNOTATION) or (meta.get("labels") or {}).get(INDEX_ANNOTATION)
        if raw is None or not str(raw).isdigit():
            continue
        index = int(raw)
        if index not in newest or meta.get("creationTimestamp", "") >= newest[index]["metadata"].get("creationTimestamp", ""):
            newest[index] = pod
    return newest


def node_states(job_name: str, pods: list[dict[str, Any]]) -> list[NodeState]:
    """Pods of the Job → one NodeState per completion index (its newest pod), sorted by index."""
    out = []
    for index, pod in sorted(newest_pods(pods).items()):
        phase = (pod.get("status") or {}).get("phase", "Pending")
        name = f"{job_name}-{index}"
        if pod["metadata"].get("deletionTimestamp"):
            out.append(NodeState(name, "lost", "pod is being deleted"))
        elif phase == "Running":
            out.append(NodeState(name, "running"))
        elif phase == "Succeeded":
            out.append(NodeState(name, "finished"))
        elif phase == "Failed":
            out.append(NodeState(name, "lost", _terminated(pod)))
        else:
            out.append(NodeState(name, "pending", _waiting_reason(pod)))
    return out


async def pod_log_stream(response: Any) -> AsyncIterator[str]:
    """An opened pod log's whole lines as they arrive (the last one completed at the end); closed when done."""
    chunks = response.stream(READ_BYTES, decode_content=True)
    partial = b""
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            data, _, partial = (partial + chunk).rpartition(b"\n")
            if data:
                yield data.decode("utf-8", "replace") + "\n"
        if partial:
            yield partial.decode("utf-8", "replace") + "\n"
    finally:
        with contextlib.suppress(Exception):  # unblocks a read still waiting in its thread
            response.close()
