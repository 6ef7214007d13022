"""A small synchronous client of the controller API, used by `rolloutctl` (and tests).

Resolves where the controller is and which token to send: flags, then `ROLLOUTD_SERVER` /
`ROLLOUTD_TOKEN` / `ROLLOUTD_TOKEN_FILE`, then the config file
(`$ROLLOUTD_CONFIG` or `~/.config/rolloutd/config.yaml`: `server`, `token`, `tokenFile`), then the
defaults of a local controller (`http://127.0.0.1:7350`, token in its default data dir).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import yaml

from .config import API_PREFIX as PREFIX
from .config import DEFAULT_HOST, DEFAULT_PORT, default_data_dir


class ClientError(Exception):
    """A failure the CLI reports as one clear line (and exit code 1)."""

    def __init__(self, message: str, status: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status or {}

    @property
    def code(self) -> int | None:
        return self.status.get("code")


def config_path() -> Path:
    return Path(os.environ.get("ROLLOUTD_CONFIG") or Path.home() / ".config" / "rolloutd" / "config.yaml")


@dataclass
class Connection:
    server: str
    token: str


def resolve(server: str | None = None, token_file: Path | None = None, token: str | None = None) -> Connection:
    cfg: dict[str, Any] = {}
    path = config_path()
    if path.exists():
        try:
            cfg = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ClientError(f"config file {path} is not valid YAML: {e}") from None
    server = server or os.environ.get("ROLLOUTD_SERVER") or cfg.get("server") or f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    token = token or (None if token_file else os.environ.get("ROLLOUTD_TOKEN")) or (None if token_file else cfg.get("token"))
    if not token:
        tf = token_file or os.environ.get("ROLLOUTD_TOKEN_FILE") or cfg.get("tokenFile") or default_data_dir() / "token"
        tf = Path(tf).expanduser()
        try:
            token = tf.read_text().strip()
        except OSError as e:
            raise ClientError(
                f"no API token: cannot read {tf} ({e.strerror}); pass --token-file, set ROLLOUTD_TOKEN, "
                f"or write 'token:' / 'tokenFile:' in {path}"
            ) from None
    return Connection(server.rstrip("/"), token)


class ApiClient:
    def __init__(self, conn: Connection, timeout: float = 30.0):
        self.conn = conn
        self.http = httpx.Client(base_url=conn.server, timeout=timeout,
                                 headers={"Authorization": f"Bearer {conn.token}"})

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ClientError(f"cannot reach the controller at {self.conn.server}: {e} "
                              "(is `rolloutd controller` running? see --server / ROLLOUTD_SERVER)") from None
        if r.status_code >= 400:
            raise _status_error(r)
        return r

    def apply(self, doc: dict[str, Any]) -> tuple[dict[str, Any], str]:
        name = (doc.get("metadata") or {}).get("name")
        if not name:
            raise ClientError("metadata.name is required")
        r = self._request("PUT", f"{PREFIX}/rolloutjobs/{name}", content=json.dumps(doc),
                          headers={"Content-Type": "application/json"})
        return r.json(), r.headers.get("x-rolloutd-outcome", "configured")

    def get(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"{PREFIX}/rolloutjobs/{name}").json()

    def list(self, selector: str | None = None) -> dict[str, Any]:
        params = {"labelSelector": selector} if selector else {}
        return self._request("GET", f"{PREFIX}/rolloutjobs", params=params).json()

    def delete(self, name: str) -> dict[str, Any]:
        return self._request("DELETE", f"{PREFIX}/rolloutjobs/{name}").json()

    def events(self, name: str) -> list[dict[str, Any]]:
        return self._request("GET", f"{PREFIX}/rolloutjobs/{name}/events").json()["items"]

    def trajectories(self, name: str, cursor: int = 0, follow: bool = False,
                     timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Every trajectory after `cursor` (each carries its `seq`); with `follow`, until the job ends.
        A dropped stream is resumed from the last `seq` received, so nothing is lost or repeated."""
        failures = 0
        while True:
            params: dict[str, Any] = {"cursor": cursor}
            if follow:
                params["follow"] = "true"
                if timeout:
                    params["timeoutSeconds"] = timeout
            try:
                with self.http.stream("GET", f"{PREFIX}/rolloutjobs/{name}/trajectories", params=params,
                                      timeout=httpx.Timeout(30.0, read=60.0)) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise _status_error(r)
                    for line in r.iter_lines():
                        if line.strip():
                            obj = json.loads(line)
                            cursor = obj["seq"]
                            yield obj
                    failures = 0
                return
            except httpx.TransportError as e:
                failures += 1
                if failures > 5:
                    raise ClientError(f"trajectory stream from {self.conn.server} keeps failing: {e}") from None
                time.sleep(min(0.2 * 2 ** failures, 5.0))

    def backends(self, name: str) -> list[dict[str, Any]]:
        return self._request("GET", f"{PREFIX}/rolloutjobs/{name}/backends").json()["items"]

    def add_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return self._request("POST", f"{PREFIX}/rolloutjobs/{name}/backends", json={"url": url}).json()["items"]

    def remove_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return self._request("DELETE", f"{PREFIX}/rolloutjobs/{name}/backends", params={"url": url}).json()["items"]

    def watch(self, name: str | None = None, since: str | None = None,
              timeout: float | None = None) -> Iterator[tuple[str, dict[str, Any], str]]:
        """Yields (type, object, resourceVersion); reconnects from the last seen version if the stream drops."""
        deadline = time.monotonic() + timeout if timeout else None
        last = since
        failures = 0
        while True:
            params: dict[str, Any] = {"watch": "true"}
            if name:
                params["fieldSelector"] = f"metadata.name={name}"
            if last is not None:
                params["resourceVersion"] = last
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                params["timeoutSeconds"] = max(left, 0.01)
            try:
                with self.http.stream("GET", f"{PREFIX}/rolloutjobs", params=params,
                                      timeout=httpx.Timeout(30.0, read=60.0)) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise _status_error(r)
                    failures = 0
                    for type_, data, rv in _parse_sse(r.iter_lines()):
                        last = rv or last
                        if type_ != "BOOKMARK":
                            yield type_, data, rv
                if deadline is not None and time.monotonic() >= deadline:
                    return
            except httpx.TransportError as e:
                failures += 1
                if failures > 5:
                    raise ClientError(f"watch stream to {self.conn.server} keeps failing: {e}") from None
                time.sleep(min(0.2 * 2 ** failures, 5.0))


def _parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    event, data, rv = "message", [], None
    for line in lines:
        if line == "":
            if data:
                yield event, json.loads("\n".join(data)), rv
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            event = value
        elif key == "data":
            data.append(value)
        elif key == "id":
            rv = value


def _status_error(r: httpx.Response) -> ClientError:
    try:
        status = r.json()
    except ValueError:
        return ClientError(f"HTTP {r.status_code} from the controller: {r.text[:200]}")
    msg = f"Error from server ({status.get('reason', r.status_code)}): {status.get('message', r.text[:200])}"
    return ClientError(msg, status)
