"""The API's names, said once: group, version, URL prefix, the phases that end a job.

Plain constants without pydantic, so that the trainer client and the node daemon can import them
cheaply; `rolloutjob.py` and `job_status.py` build the resource on them, the controller's routes mount under the prefix.
"""
from __future__ import annotations

from urllib.parse import quote

GROUP = "rolloutd.io"
VERSION = "v1alpha1"
API_PREFIX = f"/apis/{GROUP}/{VERSION}"
TERMINAL_PHASES = frozenset({"Succeeded", "Failed", "Cancelled"})
DEFAULT_NAMESPACE = "default"


def job_key(namespace: str | None, name: str) -> str:
    """The controller's one identity of a job: its name in `default`, else "namespace/name" (neither may
    hold a "/", so the key is unambiguous; a bare name, as daemons of older versions send it, means `default`)."""
    return name if namespace in (None, "", DEFAULT_NAMESPACE) else f"{namespace}/{name}"


def split_key(key: str) -> tuple[str, str]:
    """(namespace, name) of a `job_key`."""
    namespace, _, name = key.rpartition("/")
    return namespace or DEFAULT_NAMESPACE, name


def job_path(key: str, *sub: str) -> str:
    """The job's namespaced API path (the trainer routes and the node protocol live under it)."""
    namespace, name = split_key(key)
    return "/".join([f"{API_PREFIX}/namespaces/{quote(namespace, safe='')}/rolloutjobs/{quote(name, safe='')}", *sub])
