"""What the sync and the async trainer clients share: where the controller is, typed errors,
request building and response decoding, the SSE parser. No I/O happens here.

Used by `rolloutd.client.sync.RolloutClient` (also `rolloutctl`'s client) and
`rolloutd.client.aio.AsyncRolloutClient`. Imports only httpx, the standard library and rolloutd's
import-light modules (`crds.names`, `controller.config`, `controller.documents`): PyYAML is imported
lazily, only to read a YAML job file or config file.

Connection resolution (first hit wins, per item):
  server: argument, `ROLLOUTD_SERVER`, config `server`, `http://127.0.0.1:7350`;
  token:  argument `token`, else the file of argument `token_file`, else `ROLLOUTD_TOKEN`,
          config `token`, the file of `ROLLOUTD_TOKEN_FILE` / config `tokenFile`, and finally the
          local controller's `<data dir>/token`.
The config file is `$ROLLOUTD_CONFIG`, else `~/.config/rolloutd/config.yaml`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator
from urllib.parse import quote

import httpx

from rolloutd.controller.config import DEFAULT_HOST, DEFAULT_PORT, DataDir, default_data_dir
from rolloutd.controller.documents import load_documents, malformed_yaml
from rolloutd.crds.names import API_PREFIX, TERMINAL_PHASES

JOBS = f"{API_PREFIX}/rolloutjobs"
# Long-polls are cut into slices of this many seconds (the server answers with the current state
# when a slice ends), so no proxy or idle timeout ever sees a silent connection for long.
POLL_SLICE_SECONDS = 30.0
STREAM_TIMEOUT = httpx.Timeout(30.0, read=60.0)  # the server sends a keep-alive every 5 s
STREAM_RETRIES = 5


# ---------------------------------------------------------------- errors


class RolloutdError(Exception):
    """A failure of a controller call. `status` is the server's Kubernetes `Status` object
    (`{kind: Status, reason, message, code, details: {causes: [{field, reason, message}]}}`) or
    `{}` when the controller never answered (see `ConnectionFailed`)."""

    def __init__(self, message: str, status: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status or {}

    @property
    def code(self) -> int | None:
        return self.status.get("code")

    @property
    def reason(self) -> str | None:
        return self.status.get("reason")

    @property
    def causes(self) -> list[dict[str, Any]]:
        return list((self.status.get("details") or {}).get("causes") or [])


class BadRequest(RolloutdError):
    """400: malformed body or parameters."""


class Unauthorized(RolloutdError):
    """401: missing or wrong token."""


class NotFound(RolloutdError):
    """404: no such job (or batch, or backend)."""


class Conflict(RolloutdError):
    """409: already exists, or a concurrent update won."""


class Gone(RolloutdError):
    """410: a watch resumed from a version the server no longer keeps."""


class Invalid(RolloutdError):
    """422: the job does not validate; `causes` name each field."""


class ConnectionFailed(RolloutdError):
    """The controller could not be reached (or a stream kept failing after retries)."""


class WaitTimeout(RolloutdError, TimeoutError):
    """A client-side wait ended before its condition held. `last` is the last state seen
    (the job object, or the `Batch` for `next_batch`)."""

    def __init__(self, message: str, last: Any = None):
        super().__init__(message)
        self.last = last


class JobEnded(RolloutdError):
    """`wait` for a condition on a job that ended (Failed/Cancelled/deleted) without it."""

    def __init__(self, message: str, job: dict[str, Any] | None = None):
        super().__init__(message)
        self.job = job


_BY_CODE: dict[int, type[RolloutdError]] = {400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict,
                                            410: Gone, 422: Invalid}


def status_error(r: httpx.Response) -> RolloutdError:
    """The typed error for a ≥400 response (its body read already)."""
    try:
        status = r.json()
    except ValueError:
        status = None
    if not isinstance(status, dict) or status.get("kind") != "Status":
        cls = _BY_CODE.get(r.status_code, RolloutdError)
        return cls(f"HTTP {r.status_code} from the controller: {r.text[:200]}",
                   {"code": r.status_code, "reason": r.reason_phrase, "message": r.text[:200]})
    status.setdefault("code", r.status_code)
    cls = _BY_CODE.get(int(status["code"]), RolloutdError)
    return cls(f"Error from server ({status.get('reason', r.status_code)}): {status.get('message', '')}", status)


def unreachable(server: str, e: Exception) -> ConnectionFailed:
    return ConnectionFailed(f"cannot reach the controller at {server}: {e} "
                            "(is `rolloutd controller` running? see server= / ROLLOUTD_SERVER)")


# ---------------------------------------------------------------- connection


def config_path() -> Path:
    return Path(os.environ.get("ROLLOUTD_CONFIG") or Path.home() / ".config" / "rolloutd" / "config.yaml")


@dataclass
class Connection:
    server: str
    token: str


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    text = path.read_text()
    try:
        import yaml
    except ImportError:  # a trainer image without PyYAML: the file is flat `key: value` lines
        return {k.strip(): v.strip().strip("'\"") for k, _, v in
                (ln.partition(":") for ln in text.splitlines() if ":" in ln and not ln.lstrip().startswith("#"))}
    try:
        cfg = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise RolloutdError(f"config file {path}: {malformed_yaml(e)}") from None
    if not isinstance(cfg, dict):
        raise RolloutdError(f"config file {path}: expected a mapping (server, token, tokenFile)")
    return cfg


def resolve(server: str | None = None, token_file: str | Path | None = None, token: str | None = None) -> Connection:
    """Where the controller is and which bearer token to send (see the module docstring)."""
    path = config_path()
    cfg = _read_config(path)
    server = server or os.environ.get("ROLLOUTD_SERVER") or cfg.get("server") or f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    if not token and not token_file:
        token = os.environ.get("ROLLOUTD_TOKEN") or cfg.get("token")
    if not token:
        tf = token_file or os.environ.get("ROLLOUTD_TOKEN_FILE") or cfg.get("tokenFile") or DataDir(default_data_dir()).token
        tf = Path(tf).expanduser()
        try:
            token = tf.read_text().strip()
        except OSError as e:
            raise RolloutdError(
                f"no API token: cannot read {tf} ({e.strerror}); pass token= or token_file=, set ROLLOUTD_TOKEN, "
                f"or write 'token:' / 'tokenFile:' in {path}"
            ) from None
    return Connection(str(server).rstrip("/"), token)


def client_options(conn: Connection, timeout: float) -> dict[str, Any]:
    return {"base_url": conn.server, "timeout": timeout, "headers": {"Authorization": f"Bearer {conn.token}"}}


# ---------------------------------------------------------------- requests


def job_path(name: str, *sub: str) -> str:
    return "/".join([JOBS, quote(name, safe=""), *sub])


def load_job(job: dict[str, Any] | str | Path) -> dict[str, Any]:
    """A RolloutJob document from a mapping, a path to a YAML/JSON file, or YAML/JSON text."""
    if isinstance(job, dict):
        doc = job
    else:
        text = None
        if isinstance(job, Path) or ("\n" not in job and len(job) < 4096 and Path(job).expanduser().is_file()):
            try:
                text = Path(job).expanduser().read_text()
            except OSError as e:
                raise RolloutdError(f"cannot read {job}: {e.strerror}") from None
        else:
            text = job
        doc = _parse_text(text, str(job) if text is not job else "<text>")
    if not isinstance(doc, dict):
        raise RolloutdError(f"expected a RolloutJob mapping, got {type(doc).__name__}")
    if not (doc.get("metadata") or {}).get("name"):
        raise RolloutdError("metadata.name is required")
    return doc


def _parse_text(text: str, where: str) -> Any:
    try:
        docs = load_documents(text, where)
    except ImportError:
        raise RolloutdError(f"{where}: reading YAML needs PyYAML; pass the job as a dict or JSON") from None
    except ValueError as e:
        raise RolloutdError(str(e)) from None
    if len(docs) != 1:
        raise RolloutdError(f"{where}: expected exactly one RolloutJob document, found {len(docs)}")
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


def parse_sse(lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    """Server-sent events → (event, data, id); comments (keep-alives) skipped."""
    parser = SSEParser()
    for line in lines:
        ev = parser.feed(line)
        if ev is not None:
            yield ev


class SSEParser:
    """Line-at-a-time SSE parsing (shared by the sync and async watch loops)."""

    def __init__(self) -> None:
        self.event, self.data, self.id = "message", [], None

    def feed(self, line: str) -> tuple[str, dict[str, Any], str | None] | None:
        if line == "":
            out = (self.event, json.loads("\n".join(self.data)), self.id) if self.data else None
            self.event, self.data = "message", []
            return out
        if line.startswith(":"):
            return None
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            self.event = value
        elif key == "data":
            self.data.append(value)
        elif key == "id":
            self.id = value
        return None


# ---------------------------------------------------------------- conditions


def condition_met(obj: dict[str, Any], condition: str) -> tuple[bool, str | None]:
    """(met, why it never will be). `condition`: a condition type (`Complete`, `Provisioned`, …,
    met when its status is True) or `phase=PHASE`."""
    st = obj.get("status") or {}
    phase = st.get("phase", "Pending")
    if condition.lower().startswith("phase="):
        want = condition.split("=", 1)[1]
        if phase.lower() == want.lower():
            return True, None
    else:
        ctype, _, value = condition.partition("=")
        value = value or "True"
        cond = next((c for c in st.get("conditions", []) if c.get("type", "").lower() == ctype.lower()), None)
        if cond and str(cond.get("status", "")).lower() == value.lower():
            return True, None
    if phase in TERMINAL_PHASES:
        why = next((c.get("message") for c in st.get("conditions", []) if c.get("type") == "Complete"), "") \
            or st.get("message", "")
        return False, f"job ended {phase}" + (f": {why}" if why else "")
    return False, None


# ---------------------------------------------------------------- one call = one request + a decoder


@dataclass
class Call:
    """One request to the controller and how to read its answer; run by either client."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    timeout: Any = "default"      # "default": the client's; else an httpx timeout (None = wait forever)
    decode: Any = None            # callable(httpx.Response) -> value; default: the JSON body

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.params:
            kw["params"] = self.params
        if self.json is not None:
            kw["json"] = self.json
        if self.timeout != "default":
            kw["timeout"] = self.timeout
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
    def apply(job: dict[str, Any] | str | Path) -> Call:
        doc = load_job(job)
        return Call("PUT", job_path(doc["metadata"]["name"]), json=doc, decode=_with_outcome)

    @staticmethod
    def get(name: str) -> Call:
        return Call("GET", job_path(name))

    @staticmethod
    def list(selector: str | None = None) -> Call:
        return Call("GET", JOBS, params={"labelSelector": selector} if selector else None)

    @staticmethod
    def delete(name: str) -> Call:
        return Call("DELETE", job_path(name))

    @staticmethod
    def events(name: str) -> Call:
        return Call("GET", job_path(name, "events"), decode=_items)

    @staticmethod
    def groups(name: str) -> Call:
        return Call("GET", job_path(name, "groups"), decode=_items)

    @staticmethod
    def trajectory_page(name: str, cursor: int, limit: int) -> Call:
        def decode(r: httpx.Response) -> list[dict[str, Any]]:
            return [t for t in map(trajectory_line, r.text.splitlines()) if t is not None]
        return Call("GET", job_path(name, "trajectories"), params={"cursor": cursor, "limit": limit}, decode=decode)

    @staticmethod
    def request_batch(name: str, batch: int | None = None, prompts: list[int] | None = None) -> Call:
        body: dict[str, Any] = {} if batch is None else {"batch": batch}
        if prompts is not None:
            body["prompts"] = [int(p) for p in prompts]
        return Call("POST", job_path(name, "batches"), json=body)

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
    def watch(name: str | None, since: str | None, timeout: float | None) -> Call:
        params: dict[str, Any] = {"watch": "true"}
        if name:
            params["fieldSelector"] = f"metadata.name={name}"
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


class GroupAssembler:
    """Trajectories in, whole groups out: a group is yielded once all `samples` of it arrived
    (keyed by the trajectory's `group` id when the server sends one, else by its prompt)."""

    def __init__(self, samples: int):
        self.samples = samples
        self.open: dict[Any, list[dict[str, Any]]] = {}

    def add(self, t: dict[str, Any]):
        from .batch import Group

        key = t.get("group", t.get("prompt"))
        got = self.open.setdefault(key, [])
        got.append(t)
        if len(got) < self.samples:
            return None
        del self.open[key]
        got.sort(key=lambda s: s.get("sample", 0))
        return Group(group=key, prompt=t.get("prompt", -1), samples=got, rewards=[s.get("reward") for s in got],
                     state="complete")
