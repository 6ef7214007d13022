"""The Kubernetes objects of a job's node daemons, as pure functions: the Indexed Job (a pod per node) and the
Secret holding the job's node credential, with their names, labels and owner.

Called by `executor.py` when it creates them; no API call here, so tests check them against the Kubernetes
schemas (tests/controller/executors/test_kubernetes_executor.py, charts/). The daemon's side is the local and
Slurm executors' contract: `rolloutd node --slot <index>` with ROLLOUTD_CONTROLLER / ROLLOUTD_JOB in its
environment and ROLLOUTD_JOIN_TOKEN from the Secret (never in the Job's spec, which anyone who may read Jobs can see).
"""
from __future__ import annotations

import hashlib
from typing import Any

from rolloutd.crds import nodeenv
from rolloutd.crds.rolloutjob import RolloutJob

from .pods import CONTAINER

RESTARTS_PER_NODE = 5  # like the Slurm batch script's supervisor: a crashing daemon's pod is replaced this often


def resource_name(job: str) -> str:
    """The Job's (and its Secret's) name for a job key: `rolloutd-<job>`, shortened with a hash so that the
    pods' hostnames (`<name>-<index>`) stay within 63 characters; a key outside `default` always has the hash
    ("a-b/c" and "a/b-c" must not meet)."""
    name = f"rolloutd-{job.replace('/', '-')}"
    if len(name) <= 52 and "/" not in job:
        return name
    return f"{name[:43]}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"


def labels(job: RolloutJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": "rolloutd-node", "app.kubernetes.io/managed-by": "rolloutd",
            "rolloutd.io/job": job.metadata.name,
            "rolloutd.io/namespace": job.metadata.namespace, "rolloutd.io/uid": job.metadata.uid or ""}


def secret_manifest(job: RolloutJob, *, namespace: str, credential: str, owned: bool = False) -> dict[str, Any]:
    """The Secret holding the job's node credential (key `join-token`, as daemons of earlier versions read it)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _metadata(job, namespace, owned),
            "stringData": {"join-token": credential}}


def owner_references(job: RolloutJob, namespace: str) -> list[dict[str, Any]]:
    """The RolloutJob as the owner of its Job and Secret when they share its namespace on the same cluster
    (operator mode): Kubernetes' garbage collector then removes them even if the RolloutJob is force-deleted."""
    if namespace != job.metadata.namespace or not job.metadata.uid:
        return []
    return [{"apiVersion": job.api_version, "kind": job.kind, "name": job.metadata.name, "uid": job.metadata.uid,
             "controller": True, "blockOwnerDeletion": False}]


def _metadata(job: RolloutJob, namespace: str, owned: bool) -> dict[str, Any]:
    meta = {"name": resource_name(job.metadata.key), "namespace": namespace, "labels": labels(job)}
    if owned and (refs := owner_references(job, namespace)):
        meta["ownerReferences"] = refs
    return meta


def job_manifest(job: RolloutJob, *, namespace: str, image: str, controller_url: str,
                 drain_seconds: float = 30.0, owned: bool = False) -> dict[str, Any]:
    """The Indexed Job running `spec.executor.nodes` node daemons of `job` (pure: no API call); `owned`: the
    RolloutJob is an object of the same cluster (operator mode), named as its owner."""
    k = job.spec.executor.kubernetes
    nodes = job.spec.executor.nodes
    name = resource_name(job.metadata.key)
    # the daemon's contract (crds/nodeenv.py); the join token comes from the Secret, never the Job spec
    env = [{"name": nodeenv.CONTROLLER, "value": controller_url},
           {"name": nodeenv.JOB, "value": job.metadata.key},
           {"name": nodeenv.JOIN_TOKEN, "valueFrom": {"secretKeyRef": {"name": name, "key": "join-token"}}},
           {"name": nodeenv.DRAIN_SECONDS, "value": f"{drain_seconds:g}"}]
    container: dict[str, Any] = {
        "name": CONTAINER, "image": k.image or image,
        # JOB_COMPLETION_INDEX is set by the Job controller in every pod of an Indexed Job
        "command": ["rolloutd", "node", "--slot", "$(JOB_COMPLETION_INDEX)"],
        "env": env,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            **({"procMount": "Unmasked"} if k.user_namespace else {})},
    }
    if k.image_pull_policy:
        container["imagePullPolicy"] = k.image_pull_policy
    resources = {key: dict(value) for key, value in (("requests", k.resources.requests),
                                                       ("limits", k.resources.limits)) if value}
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # a failed pod is replaced by the Job (backoffLimitPerIndex), exit 2 fails it
        "automountServiceAccountToken": False,  # a daemon talks to rolloutd, never to the Kubernetes API
        "terminationGracePeriodSeconds": int(drain_seconds) + 15,
        "securityContext": {"runAsNonRoot": True, "runAsUser": k.run_as_user, "runAsGroup": k.run_as_user,
                            "seccompProfile": {"type": k.seccomp_profile},
                            "appArmorProfile": {"type": k.app_armor_profile}},
        "containers": [container],
    }
    if k.user_namespace:
        pod["hostUsers"] = False
    if k.service_account:
        pod["serviceAccountName"] = k.service_account
    if k.node_selector:
        pod["nodeSelector"] = dict(k.node_selector)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": _metadata(job, namespace, owned),
        "spec": {
            "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
            "backoffLimitPerIndex": RESTARTS_PER_NODE,
            "podFailurePolicy": {"rules": [
                # `rolloutd node` exits 2 when the controller refuses it or it is misconfigured: final
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [2]}},
                # evicted or preempted pods do not count against the per-node budget
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "template": {"metadata": {"labels": labels(job)}, "spec": pod},
        },
    }
