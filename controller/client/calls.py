"""Every single-request call of the trainer client: the request to send and how to read its answer.

`Calls.x(...)` builds a `Call`; the sync and the async client (`sync`, `aio`) send it with their own
httpx client, so the two cannot drift apart. Also the job document loader (a dict, a file or text) and
the trajectory line decoder. No I/O happens here but reading a job file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rolloutd.crds.kit.documents import load_documents
from rolloutd.crds.names import API_PREFIX, job_key, job_path, split_key

from .errors import ClientError

JOBS = f"{API_PREFIX}/rolloutjobs"
# Long-polls are cut into slices of this many seconds (the server answers with the current state
# when a slice ends), so no proxy or idle timeout ever sees a silent connection for long.
POLL_SLICE_SECONDS = 30.0
STREAM_TIMEOUT = httpx.Timeout(30.0, read=60.0)  # the server sends a keep-alive every 5 s


APPLY_HEADER = "X-Rolloutd-Apply"  # the namespaced PUT creates or updates (controller/kube/rolloutjobs.py)


def load_job(job: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A RolloutJob document from a mapping, a path to a YAML/JSON file, or YAML/JSON text. From a file, its
    relative `spec.tasks.source` and `spec.llm.tokenizer` are resolved against the file's directory, as
    `rolloutctl apply -f FILE` does (`crds/spec_paths.py`); a mapping or text is sent as it is."""
    base = None
    if isinstance(job, dict):
        doc = job
    else:
        text = None
        if isinstance(job, Path) or ("\n" not in job and len(job) < 4096 and Path(job).expanduser().is_file()):
            try:
                text = Path(job).expanduser().read_text()
            except OSError as e:
                raise ClientError(f"cannot read {job}: {e.strerror}") from None
            base = Path(job).expanduser().parent
        else:
            text = job
        doc = _parse_text(text, str(job) if text is not job else "<text>")
    if base is not None and isinstance(doc, dict):
        from rolloutd.crds.spec_paths import resolve_paths

        doc = resolve_paths(doc, base)
    if not isinstance(doc, dict):
        raise ClientError(f"expected a RolloutJob mapping, got {type(doc).__name__}")
    if not (doc.get("metadata") or {}).get("name"):
        raise ClientError("metadata.name is required")
    return doc


def _parse_text(text: str, where: str) -> Any:
    try:
        docs = load_documents(text, where)
    except ImportError:
        raise ClientError(f"{where}: reading YAML needs PyYAML; pass the job as a dict or JSON") from None
    except ValueError as e:
        raise ClientError(str(e)) from None
    if len(docs) != 1:
        raise ClientError(f"{where}: expected exactly one RolloutJob document, found {len(docs)}")
    return docs[0]


def trajectory_line(line: str) -> dict[str, Any] | None:
    """One JSON line of the trajectory stream (None for a keep-alive). A line cut short by a
    dropped connection raises ValueError: the caller resumes from the last complete `seq`."""
    line = line.strip()
    if not line:
        return None
    obj = json.loads(line)
    if not isinstance(obj, dict) or "seq" not in obj:
        raise ValueError(f"not a trajectory line: {line[:80]}")
    return obj


@dataclass
class Call:
    """One request to the controller and how to read its answer; run by either client."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    timeout: Any = "default"      # "default": the client's; else an httpx timeout (None = wait forever)
    headers: dict[str, str] | None = None
    decode: Any = None            # callable(httpx.Response) -> value; default: the JSON body
    # safe to send again after a connection lost mid-answer (GET, PUT; POST/DELETE only where said)
    idempotent: bool | None = None

    def __post_init__(self) -> None:
        if self.idempotent is None:
            self.idempotent = self.method in ("GET", "PUT")

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.params:
            kw["params"] = self.params
        if self.json is not None:
            kw["json"] = self.json
        if self.timeout != "default":
            kw["timeout"] = self.timeout
        if self.headers:
            kw["headers"] = self.headers
        return kw

    def result(self, r: httpx.Response) -> Any:
        return self.decode(r) if self.decode else r.json()


def _items(r: httpx.Response) -> list[dict[str, Any]]:
    return r.json()["items"]


def _with_outcome(r: httpx.Response) -> tuple[dict[str, Any], str]:
    return r.json(), r.headers.get("x-rolloutd-outcome", "configured")


class Calls:
    """The request of every single-request method, shared by `RolloutClient` and
    `AsyncRolloutClient` (so the two cannot drift apart)."""

    @staticmethod
    def apply(job: dict[str, Any] | str | Path, namespace: str) -> Call:
        """PUT to the job's namespaced path: the document's namespace, else the client's."""
        doc = load_job(job)
        meta = doc["metadata"]
        key = job_key(meta.get("namespace") or namespace, meta["name"])
        return Call("PUT", job_path(key), json=doc, headers={APPLY_HEADER: "true"}, decode=_with_outcome)

    @staticmethod
    def get(name: str) -> Call:
        return Call("GET", job_path(name))

    @staticmethod
    def list(selector: str | None, namespace: str | None) -> Call:
        """The jobs of `namespace` (None: of every namespace the token may see), narrowed by a label selector."""
        params = {"fieldSelector": f"metadata.namespace={namespace}"} if namespace is not None else {}
        return Call("GET", JOBS, params={**params, "labelSelector": selector} if selector else params)

    @staticmethod
    def delete(name: str) -> Call:
        return Call("DELETE", job_path(name))

    @staticmethod
    def events(name: str) -> Call:
        return Call("GET", job_path(name, "events"), decode=_items)

    @staticmethod
    def logs(name: str, node: int | None, tail: int, follow: bool) -> Call:
        """The node daemons' log lines (plain text); a followed stream may be quiet for long: no read timeout."""
        params: dict[str, Any] = {"tail": tail, **({"node": node} if node is not None else {}),
                                  **({"follow": "true"} if follow else {})}
        return Call("GET", job_path(name, "logs"), params=params, timeout=httpx.Timeout(30.0, read=None)
                    if follow else STREAM_TIMEOUT)

    @staticmethod
    def stats(name: str) -> Call:
        return Call("GET", job_path(name, "stats"))

    @staticmethod
    def inflight(name: str, stalled_after: float | None = None, limit: int | None = None) -> Call:
        params = {**({"stalledAfterSeconds": stalled_after} if stalled_after is not None else {}),
                  **({"limit": limit} if limit is not None else {})}
        return Call("GET", job_path(name, "inflight"), params=params)

    @staticmethod
    def groups(name: str) -> Call:
        return Call("GET", job_path(name, "groups"), decode=_items)

    @staticmethod
    def trajectory_page(name: str, cursor: int, limit: int) -> Call:
        def decode(r: httpx.Response) -> list[dict[str, Any]]:
            return [t for t in map(trajectory_line, r.text.splitlines()) if t is not None]
        return Call("GET", job_path(name, "trajectories"), params={"cursor": cursor, "limit": limit}, decode=decode)

    @staticmethod
    def purge_results(name: str) -> Call:
        return Call("DELETE", job_path(name, "trajectories"), idempotent=True)

    @staticmethod
    def request_batch(name: str, batch: int | None = None, prompts: list[int] | None = None) -> Call:
        body: dict[str, Any] = {} if batch is None else {"batch": batch}
        if prompts is not None:
            body["prompts"] = [int(p) for p in prompts]
        # the server answers the current batch while it is open: a retry after a lost answer gets the same one
        return Call("POST", job_path(name, "batches"), json=body, idempotent=True)

    @staticmethod
    def batch(name: str, k: int, wait: bool, timeout: float | None, all_groups: bool) -> Call:
        params: dict[str, Any] = {}
        if wait:
            params["wait"] = "true"
            params["timeoutSeconds"] = f"{max(timeout or POLL_SLICE_SECONDS, 0.001):g}"
        if all_groups:
            params["all"] = "true"
        read = (timeout or POLL_SLICE_SECONDS) + 30.0 if wait else 30.0
        return Call("GET", job_path(name, "batches", str(int(k))), params=params,
                    timeout=httpx.Timeout(30.0, read=read))

    @staticmethod
    def announce_policy(name: str, version: int | str, weights_path: str | Path | None, pause: bool,
                        timeout: float | None) -> Call:
        body = {"version": version, "weightsPath": None if weights_path is None else str(weights_path),
                "pause": pause}
        # blocks until every backend has reloaded: no read timeout unless the caller sets one
        return Call("POST", job_path(name, "policy"), json=body, timeout=httpx.Timeout(30.0, read=timeout))

    @staticmethod
    def policy(name: str) -> Call:
        return Call("GET", job_path(name, "policy"))

    @staticmethod
    def backends(name: str) -> Call:
        return Call("GET", job_path(name, "backends"), decode=_items)

    @staticmethod
    def add_backend(name: str, url: str) -> Call:
        return Call("POST", job_path(name, "backends"), json={"url": url}, decode=_items)

    @staticmethod
    def remove_backend(name: str, url: str) -> Call:
        return Call("DELETE", job_path(name, "backends"), params={"url": url}, decode=_items)

    @staticmethod
    def watch(key: str | None, namespace: str, since: str | None, timeout: float | None) -> Call:
        """The cluster-wide watch (server-sent events), narrowed to the namespace (and to one job by `key`)."""
        params: dict[str, Any] = {"watch": "true", "fieldSelector": f"metadata.namespace={namespace}"}
        if key:
            namespace, name = split_key(key)
            params["fieldSelector"] = f"metadata.namespace={namespace},metadata.name={name}"
        if since is not None:
            params["resourceVersion"] = since
        if timeout is not None:
            params["timeoutSeconds"] = f"{max(timeout, 0.01):g}"
        return Call("GET", JOBS, params=params, timeout=STREAM_TIMEOUT)

    @staticmethod
    def follow(name: str, cursor: int, timeout: float | None) -> Call:
        params: dict[str, Any] = {"cursor": cursor, "follow": "true"}
        if timeout is not None:
            params["timeoutSeconds"] = f"{max(timeout, 0.01):g}"
        return Call("GET", job_path(name, "trajectories"), params=params, timeout=STREAM_TIMEOUT)
