"""The API's names, said once: group, version, URL prefix, the phases that end a job.

Plain constants without pydantic, so that the trainer client and the node daemon can import them
cheaply; `rolloutjob.py` builds the resource on them, the controller's routes mount under the prefix.
"""
from __future__ import annotations

GROUP = "rolloutd.io"
VERSION = "v1alpha1"
API_PREFIX = f"/apis/{GROUP}/{VERSION}"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed", "Cancelled"})
