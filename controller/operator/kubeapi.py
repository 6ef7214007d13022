"""Where the operator's API server is and how to talk to it: a `Connection` (from a kubeconfig or the
embedded controller's own address and token), kopf's HTTP session, and `JobApi`, the handlers' writes.

Used by `embedded.py` (kopf's login handler, the operator's wiring) and `handlers.py` (status through the
status subresource, core/v1 Events). Next step: the API's routes (`controller/kube/rolloutjobs.py`) or a real cluster.
"""
from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from rolloutd.crds.job_status import RolloutJobStatus
from rolloutd.crds.rolloutjob import API_VERSION, KIND, RolloutJob

GROUP_VERSION_PATH = "/apis/" + API_VERSION
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# A rolloutd controller answers a watch without this header as server-sent events (its trainer
# clients' default); Kubernetes clients ask for JSON, and so must kopf's session.
JSON_HEADERS = {"Accept": "application/json"}


@dataclass(frozen=True)
class Connection:
    """`token_file`: read again whenever it changes (kubelet rotates a pod's service-account token in place,
    and kubectl re-reads a kubeconfig's `tokenFile`); `token` is what it held at start, kept if it vanishes."""

    server: str
    token: str | None = None
    ca_path: str | None = None
    insecure: bool = False
    token_file: str | None = None
    _seen: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def bearer(self) -> str | None:
        """The token to send now: the token file's current contents (when it has one), else `token`."""
        if not self.token_file:
            return self.token
        try:
            st = os.stat(self.token_file)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if self._seen.get("stamp") != stamp:
                self._seen.update(stamp=stamp, token=Path(self.token_file).read_text().strip() or None)
        except OSError:  # between kubelet's swap of the file, or removed: the last token read
            pass
        return self._seen.get("token") or self.token

    @classmethod
    def from_kubeconfig(cls, path: Path, context: str | None = None) -> "Connection":
        """The server and bearer token of `context` (default: the current one) in a kubeconfig file."""
        doc = yaml.safe_load(Path(path).read_text()) or {}
        name = context or doc.get("current-context")
        ctx = _named(doc, "contexts", name, path)["context"]
        cluster = _named(doc, "clusters", ctx["cluster"], path)["cluster"]
        user = _named(doc, "users", ctx["user"], path).get("user") or {}
        token_file = None if user.get("token") else user.get("tokenFile")
        token = user.get("token") or (Path(token_file).read_text().strip() if token_file else None)
        ca = cluster.get("certificate-authority")
        if cluster.get("certificate-authority-data"):  # kept in a private file for the two TLS stacks
            f = tempfile.NamedTemporaryFile("wb", prefix="rolloutd-ca-", suffix=".crt", delete=False)
            f.write(base64.b64decode(cluster["certificate-authority-data"]))
            f.close()
            ca = f.name
        return cls(cluster["server"].rstrip("/"), token, ca, bool(cluster.get("insecure-skip-tls-verify")), token_file)

    @classmethod
    def in_cluster(cls, account: Path = SERVICE_ACCOUNT, env: dict[str, str] | None = None) -> "Connection":
        """Inside a pod: the cluster's API through the pod's service account (its token and CA files)."""
        env = os.environ if env is None else env
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("not in a pod (no $KUBERNETES_SERVICE_HOST): give --kubeconfig")
        host = f"[{host}]" if ":" in host else host
        # kubelet rewrites the token file before the token expires (an hour, where the API server does not
        # extend it): every request sends the file's current token, and kopf logs in again after a 401
        token_file = str(Path(account) / "token")
        token = Path(token_file).read_text().strip()
        return cls(f"https://{host}:{port}", token, str(Path(account) / "ca.crt"), token_file=token_file)

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_path)
        if self.insecure:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        return ctx

    def headers(self) -> dict[str, str]:
        token = self.bearer()
        return {**JSON_HEADERS, **({"Authorization": f"Bearer {token}"} if token else {})}

    def aiohttp_session(self) -> aiohttp.ClientSession:
        """kopf's session (returned by its login handler, called again after a 401): the token as it is now
        and the JSON Accept header."""
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=self.ssl_context()),
                                     headers=self.headers())


def _named(doc: dict[str, Any], section: str, name: str | None, path: Path) -> dict[str, Any]:
    for entry in doc.get(section) or []:
        if entry.get("name") == name:
            return entry
    raise ValueError(f"kubeconfig {path}: no {section[:-1]} named {name!r}")


class BearerAuth(httpx.Auth):
    """The connection's current token on every request (`Connection.bearer`)."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def auth_flow(self, request: httpx.Request):
        token = self.conn.bearer()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


class JobApi:
    """The handlers' writes: the status subresource (a merge patch that names the resourceVersion it
    read, so a concurrent writer makes it a 409 and the next pass reads again) and core/v1 Events."""

    def __init__(self, conn: Connection, timeout: float = 30.0):
        self.conn = conn
        self.http = httpx.AsyncClient(base_url=conn.server, headers=JSON_HEADERS, auth=BearerAuth(conn),
                                      verify=conn.ssl_context(), timeout=timeout)

    def _url(self, namespace: str, name: str = "") -> str:
        return f"{GROUP_VERSION_PATH}/namespaces/{namespace}/rolloutjobs" + (f"/{name}" if name else "")

    async def get(self, namespace: str, name: str) -> RolloutJob | None:
        """The job as stored now; None once it is gone."""
        r = await self.http.get(self._url(namespace, name))
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return RolloutJob.model_validate(r.json())

    async def patch_status(self, job: RolloutJob, status: RolloutJobStatus) -> dict[str, Any] | None:
        """Write `status` if it differs from the job's; returns the stored object (None when unchanged)."""
        old, new = job.status.wire(), status.wire()
        if old == new:
            return None
        body = {"metadata": {"resourceVersion": job.metadata.resource_version},
                "status": {**{k: None for k in old if k not in new}, **new}}
        r = await self.http.patch(self._url(job.metadata.namespace, job.metadata.name) + "/status", json=body,
                                  headers={"Content-Type": "application/merge-patch+json"})
        r.raise_for_status()
        return r.json()

    async def post_event(self, job: RolloutJob, reason: str, message: str, type_: str = "Normal") -> None:
        meta, now = job.metadata, datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"generateName": f"{meta.name}.", "namespace": meta.namespace},
                "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta.name,
                                   "namespace": meta.namespace, "uid": meta.uid},
                "type": type_, "reason": reason, "message": message[:1024], "firstTimestamp": now,
                "lastTimestamp": now, "source": {"component": "rolloutd-operator"},
                "reportingComponent": "rolloutd-operator"}
        r = await self.http.post(f"/api/v1/namespaces/{meta.namespace}/events", json=body)
        r.raise_for_status()

    async def aclose(self) -> None:
        await self.http.aclose()
