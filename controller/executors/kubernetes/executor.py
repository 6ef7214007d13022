"""The Kubernetes executor: a RolloutJob's node daemons as one Indexed Job (a pod per node).

Called by the reconciler (`ensure` / `observe` / `release`, the `Executor` protocol) for jobs with
`executor.kind: kubernetes`. It creates the Job and its Secret that `manifests.py` builds with the official
`kubernetes` client (the `[kubernetes]` extra, imported on first use: a controller without it fails such a job
with a condition saying what to install), scales it by patching `parallelism` and `completions` together (elastic
Indexed Job), maps its pods to NodeStates (`pods.py`) and deletes it (propagationPolicy Background: the pods get
SIGTERM and drain) on release.

The job's node credential is minted on the Job's creation and revoked on release; the daemons read it from the
Secret the executor writes beside the Job.
Test seam: `api_client` (a `kubernetes.client.ApiClient` factory, `clients.py`).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable

from rolloutd.crds import nodeenv
from rolloutd.crds.rolloutjob import RolloutJob

from ..base import Credentials, ExecutorError, NodeState, Site
from ..logs import MAX_BYTES, NoLogs, merged
from .clients import api_client_for, default_api_client
from .manifests import job_manifest, resource_name, secret_manifest
from .pods import CONTAINER, newest_pods, node_states, pod_log_stream

log = logging.getLogger("rolloutd.executor.kubernetes")

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
SERVICE_ACCOUNT_NS = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
INSTALL_HINT = "pip install 'rolloutd[kubernetes]'"


def _condition(job: dict[str, Any], type_: str) -> str | None:
    """`reason: message` of the Job's condition `type_` when it is True, else None."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return f"{cond.get('reason') or type_}: {cond.get('message') or ''}".rstrip(": ")
    return None



class KubernetesExecutor:
    """`in_job_namespace`: operator mode, where RolloutJobs are objects of the cluster the Jobs go to: a job's
    daemons run in the RolloutJob's own namespace (else in `namespace`, the controller's), owned by it."""
    kind = "kubernetes"
    shares_files = False  # its daemons run elsewhere: they do not see this controller's files

    def __init__(self, controller_url: str, credentials: Credentials, *, namespace: str | None = None,
                 image: str | None = None, drain_seconds: float = nodeenv.DEFAULT_DRAIN_SECONDS,
                 api_client: Callable[[], Any] = default_api_client, in_job_namespace: bool = False):
        self.controller_url = controller_url
        self.credentials = credentials
        self.in_job_namespace = in_job_namespace
        # `namespace`, `image`, `drain_seconds`: the controller's settings ($ROLLOUTD_K8S_NAMESPACE, ...)
        self.namespace = namespace or _own_namespace()
        self.image = image or ""
        self.drain = drain_seconds
        self._api_factory = api_client
        self._api: Any = None
        self._released: set[str] = set()  # uids whose Job is gone: release() is called on every pass

    @classmethod
    def from_site(cls, site: Site) -> KubernetesExecutor:
        """An Indexed Job per RolloutJob: on the controller's cluster (its namespace), or in operator mode on the
        kubeconfig's, in each RolloutJob's own namespace. The client loads on first use ([kubernetes] extra)."""
        kube, settings = site.kube, site.settings
        client = default_api_client if kube is None else api_client_for(kube.server, kube.bearer, kube.ca_path,
                                                                         kube.insecure)
        return cls(site.remote_url(), site.credentials, namespace=settings.k8s_namespace,
                   image=settings.k8s_node_image, drain_seconds=settings.drain_seconds, api_client=client,
                   in_job_namespace=kube is not None)

    # ------------------------------------------------------------ client

    def _client(self) -> tuple[Any, Any, type[Exception]]:
        try:
            from kubernetes import client
            from kubernetes.client.exceptions import ApiException
        except ImportError:
            raise ExecutorError(f"the kubernetes executor needs the kubernetes Python client on the controller: "
                                f"{INSTALL_HINT}", reason="KubernetesClientMissing", permanent=True) from None
        if self._api is None:
            try:
                self._api = self._api_factory()
            except Exception as e:  # noqa: BLE001 - no kubeconfig, unreadable service account token...
                raise ExecutorError(f"cannot configure the Kubernetes client: {e}", reason="KubernetesUnavailable",
                                    permanent=True) from None
        return client.BatchV1Api(self._api), client.CoreV1Api(self._api), ApiException

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any, missing_ok: bool = False, **kw: Any) -> Any:
        """One API call in a thread; API errors become ExecutorErrors (4xx that no retry fixes: permanent)."""
        _, _, api_exception = self._client()
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except api_exception as e:
            if missing_ok and e.status == 404:
                return None
            message = _status_message(e)
            permanent = e.status in (400, 401, 403, 404, 422)
            reason = "Kubernetes" + (e.reason or str(e.status)).title().replace(" ", "")
            raise ExecutorError(f"{what}: {message}", reason=reason, permanent=permanent) from None
        except Exception as e:  # noqa: BLE001 - connection refused, TLS, timeouts: retried at the next pass
            raise ExecutorError(f"{what}: {type(e).__name__}: {e}", reason="KubernetesUnreachable") from None

    def _target(self, job: RolloutJob) -> tuple[str, str]:
        own = job.metadata.namespace if self.in_job_namespace else self.namespace
        namespace = job.spec.executor.kubernetes.namespace or own
        if not namespace:
            raise ExecutorError("no namespace for the node daemons: set spec.executor.kubernetes.namespace or "
                                "$ROLLOUTD_K8S_NAMESPACE", reason="KubernetesNamespaceUnset", permanent=True)
        return namespace, resource_name(job.metadata.key)

    # ------------------------------------------------------------ Executor

    async def ensure(self, job: RolloutJob, nodes: int) -> None:
        batch, core, _ = self._client()
        namespace, name = self._target(job)
        uid = job.metadata.uid or ""
        self._released.discard(uid)
        if nodes < 1:
            await self.release(job)
            return
        current = await self._call(f"reading Job {namespace}/{name}", batch.read_namespaced_job, name, namespace,
                                   missing_ok=True)
        if current is None:
            image = job.spec.executor.kubernetes.image or self.image
            if not image:
                raise ExecutorError("no image for the node daemons: set spec.executor.kubernetes.image or "
                                    "$ROLLOUTD_K8S_NODE_IMAGE", reason="KubernetesImageUnset", permanent=True)
            await self._write_secret(core, job, namespace)
            body = job_manifest(job, namespace=namespace, image=image, controller_url=self.controller_url,
                                drain_seconds=self.drain, owned=self.in_job_namespace)
            await self._call(f"creating Job {namespace}/{name}", batch.create_namespaced_job, namespace, body)
            log.info("created Job %s/%s for %s (%d node(s))", namespace, name, job.metadata.name, nodes)
            return
        current = batch.api_client.sanitize_for_serialization(current)
        if (current["metadata"].get("labels") or {}).get("rolloutd.io/uid") != uid:
            # the Job of an earlier RolloutJob of the same name: let it go first, create ours next pass
            await self._delete(batch, core, namespace, name)
            raise ExecutorError(f"Job {namespace}/{name} belongs to an earlier RolloutJob of this name; "
                                f"deleting it", reason="KubernetesJobReplaced")
        failed = _condition(current, "Failed")
        if failed:
            raise ExecutorError(f"Job {namespace}/{name} failed: {failed}", reason="KubernetesJobFailed",
                                permanent=True)
        if _condition(current, "Complete"):
            # every daemon exited 0 (drained) while rollouts remain: a completed Job never starts pods again
            await self._delete(batch, core, namespace, name)
            raise ExecutorError(f"every node daemon of Job {namespace}/{name} exited while rollouts remain; "
                                f"replacing the Job", reason="KubernetesJobReplaced")
        spec = current.get("spec") or {}
        if spec.get("parallelism") != nodes or spec.get("completions") != nodes:
            # elastic Indexed Job: both change together (Kubernetes refuses them apart)
            await self._call(f"scaling Job {namespace}/{name} to {nodes}", batch.patch_namespaced_job, name,
                             namespace, {"spec": {"parallelism": nodes, "completions": nodes}},
                             _content_type="application/merge-patch+json")
            log.info("scaled Job %s/%s to %d node(s)", namespace, name, nodes)

    async def _write_secret(self, core: Any, job: RolloutJob, namespace: str) -> None:
        body = secret_manifest(job, namespace=namespace, credential=self.credentials.mint(job),
                               owned=self.in_job_namespace)
        name = body["metadata"]["name"]
        try:
            await self._call(f"creating Secret {namespace}/{name}", core.create_namespaced_secret, namespace, body)
        except ExecutorError as e:
            if e.reason != "KubernetesConflict":  # left by an earlier attempt: overwrite (no `get` on Secrets needed)
                raise
            await self._call(f"updating Secret {namespace}/{name}", core.replace_namespaced_secret, name, namespace,
                             body)

    async def observe(self, job: RolloutJob) -> list[NodeState]:
        _, core, _ = self._client()
        namespace, name = self._target(job)
        pods = await self._call(f"listing the pods of Job {namespace}/{name}", core.list_namespaced_pod, namespace,
                                label_selector=f"{JOB_NAME_LABEL}={name}")
        items = core.api_client.sanitize_for_serialization(pods).get("items") or []
        return node_states(name, items)

    async def release(self, job: RolloutJob) -> None:
        uid = job.metadata.uid or ""
        if uid in self._released:
            return
        self.credentials.revoke(job)
        try:
            batch, core, _ = self._client()
            namespace, name = self._target(job)
            await self._delete(batch, core, namespace, name)
        except ExecutorError as e:
            if not e.permanent:
                raise  # API server unreachable: the next pass tries again
            # no client, no namespace, or the API refuses: retrying every pass changes nothing
            log.error("cannot release the node daemons of %s: %s", job.metadata.name, e)
        self._released.add(uid)

    async def _delete(self, batch: Any, core: Any, namespace: str, name: str) -> None:
        # Background: the Job goes at once, the garbage collector deletes its pods, each gets SIGTERM and drains
        # within terminationGracePeriodSeconds (the daemon's ROLLOUTD_DRAIN_SECONDS + 15)
        gone = await self._call(f"deleting Job {namespace}/{name}", batch.delete_namespaced_job, name, namespace,
                                propagation_policy="Background", missing_ok=True)
        await self._call(f"deleting Secret {namespace}/{name}", core.delete_namespaced_secret, name, namespace,
                         missing_ok=True)
        if gone is not None:
            log.info("deleted Job %s/%s", namespace, name)

    async def shutdown(self) -> None:
        """Controller exit: the Job keeps running (a restarted controller finds it by name)."""

    async def logs(self, job: RolloutJob, node: int | None, tail: int, follow: bool):
        """The `node` container's log of each index's newest pod (node K: completion index K), from the API."""
        _, core, _ = self._client()
        namespace, name = self._target(job)
        listed = await self._call(f"listing the pods of Job {namespace}/{name}", core.list_namespaced_pod, namespace,
                                  label_selector=f"{JOB_NAME_LABEL}={name}")
        pods = newest_pods(core.api_client.sanitize_for_serialization(listed).get("items") or [])
        pods = {k: p for k, p in pods.items() if node is None or k == node}
        if not pods:
            raise NoLogs(f"rolloutjob {job.metadata.key} has no pod" + ("" if node is None else f" for node {node}"))
        opened = {f"node{k}": await self._call(
            f"reading the log of pod {namespace}/{p['metadata']['name']}", core.read_namespaced_pod_log,
            p["metadata"]["name"], namespace, container=CONTAINER, tail_lines=tail, follow=follow,
            limit_bytes=MAX_BYTES, _preload_content=False) for k, p in sorted(pods.items())}
        return merged({label: pod_log_stream(r) for label, r in opened.items()})


def _own_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NS.read_text().strip()
    except OSError:
        return ""


def _status_message(e: Any) -> str:
    """The API server's Status message when there is one, else the HTTP reason."""
    import json

    try:
        body = json.loads(e.body or "")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except (TypeError, ValueError):
        pass
    return f"HTTP {e.status} {e.reason or ''}".strip()
