"""The label a backend's weights carry in the engine (vLLM's `POST /update_weight_version`), which the engine stamps on
every token it generates (`weight_versions` spans on its token endpoint's final chunk): job, incarnation, version.

The controller sets it at every update it makes (controller/work/backend_http.py, node-protocol feature weight-stamps);
the node daemon reads the stamps back into per-token policy versions (agents/daemon/weightstamps.py).
"""
from __future__ import annotations

import json
import uuid
from typing import Any


def weight_label(job: str, uid: str | None, version: Any) -> str:
    """The label for job `job` (its incarnation `uid`: a job created again under the same name is another) at
    policy `version`; each update's is new (`n`), so a reload is seen in the stamps even when it announces the same
    version again."""
    return json.dumps({"job": job, "uid": uid, "version": version, "n": uuid.uuid4().hex[:8]}, separators=(",", ":"),
                      sort_keys=True)


def read_label(label: str) -> tuple[str, str | None, Any] | None:
    """(job, uid, version) of a label `weight_label` made; None for any other (the engine's own "default")."""
    try:
        d = json.loads(label)
    except (TypeError, ValueError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("job"), str) or "version" not in d:
        return None
    return d["job"], d.get("uid"), d["version"]


def foreign_version(job: str, version: Any) -> str:
    """How a job tags tokens generated with another job's weights (a shared backend): `<job>@<version>`."""
    return f"{job}@{version}"
