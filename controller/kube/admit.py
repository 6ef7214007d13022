"""Tenant admission of RolloutJob writes, the analogue of Pod Security Admission and ResourceQuota.

Called by every RolloutJob write route (`rolloutjobs.py`: create, replace, patch, server-side apply, rolloutctl's
apply, on the namespaced and the old paths) after the body validated (the watch quota is `http/streams.py`'s). A write made with a scoped token is checked against its namespace's TenantPolicy (or the restricted
profile) with `crds.tenancy.violations` plus the quotas only the controller can count (jobs and nodes of the
namespace); any refusal is one 403 Forbidden naming every field and the policy. The server sets
`metadata.annotations[ADMITTED_BY]` on every write, never from the client: the scoped token's name, or "admin",
for whoever wrote the spec; a write that leaves the spec as it was (labels, the operator's annotations) asks
for nothing new and keeps the previous writer, so touching a tenant's job never lifts its policy and an
operator's scoped token may annotate any job. `admit_and_write` takes the quota counts and the write as one
step per namespace (parallel creates cannot all see the same count); the release finalizer is the operator's
(a scoped token's write keeps it). Next step: the items quota at expansion.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

from fastapi import Request

from rolloutd.crds.names import TERMINAL_PHASES
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.tenancy import ADMITTED_BY, TenantPolicySpec, violations

from ..access.auth import ScopedToken
from ..errors import Forbidden
from ..spec_checks import check_dataset
from ..store import Store
from ..store.schema import RELEASE_FINALIZER
from ..access.tenancy import ADMIN, Policies, describe

TOKEN_KEY = "rolloutd.token"  # the ASGI scope key where the API middleware leaves a scoped token (`middleware.py`)
T = TypeVar("T")
_NS_LOCKS: dict[str, threading.Lock] = {}
_NS_LOCKS_GUARD = threading.Lock()


def scoped_token(request: Request) -> ScopedToken | None:
    """The scoped token the request was made with; None for the admin token (or the join token)."""
    return request.scope.get(TOKEN_KEY)


def _quota_problems(store: Store, policy: TenantPolicySpec, job: RolloutJob,
                    current: dict[str, Any] | None) -> list[tuple[str, str]]:
    ns, name = job.metadata.namespace, job.metadata.name
    others = [j for j in store.list_wire(namespace=ns)[0] if j["metadata"]["name"] != name]
    q, out = policy.quotas, []
    if current is None and len(others) >= q.jobs:
        out.append(("metadata.namespace", f"namespace {ns!r} holds {len(others)} RolloutJobs, its quota "
                                          f"(quotas.jobs) is {q.jobs}"))
    live = [j for j in others if j["status"].get("phase") not in TERMINAL_PHASES
            and not j["metadata"].get("deletionTimestamp")]
    held = sum(int(j["spec"].get("executor", {}).get("nodes", 1)) for j in live)
    if job.spec.executor.nodes <= q.nodes < held + job.spec.executor.nodes:
        out.append(("spec.executor.nodes", f"{job.spec.executor.nodes} more nodes over the {held} the namespace's "
                                           f"other jobs hold is over its node quota (quotas.nodes {q.nodes})"))
    return out


def admit(request: Request, store: Store, policies: Policies, job: RolloutJob, current: dict[str, Any] | None) -> None:
    """Check `job` (about to be stored; `current`: the stored one, None on create) and stamp ADMITTED_BY;
    403 Forbidden naming each field and the policy when a scoped token asks for more than it may."""
    _admit(request, store, policies, job, current)
    if current is None and scoped_token(request) is None:
        check_dataset(job)  # the admin's new job: a dataset the controller cannot read is a 422 now, not a failure later


def _admit(request: Request, store: Store, policies: Policies, job: RolloutJob, current: dict[str, Any] | None) -> None:
    token = scoped_token(request)
    held = (current or {}).get("metadata", {}).get("finalizers") or []
    # only the operator drops it: the admin's token or a cluster-wide one (an operator's service account), as for status
    if token is not None and token.namespaces and RELEASE_FINALIZER in held \
            and RELEASE_FINALIZER not in job.metadata.finalizers:
        job.metadata.finalizers = [RELEASE_FINALIZER, *job.metadata.finalizers]
    annotations = dict(job.metadata.annotations)
    annotations.pop(ADMITTED_BY, None)  # never the client's
    if current is not None and current.get("spec") == job.spec.wire():  # asks for nothing new: the writer stays
        prior = (current.get("metadata") or {}).get("annotations", {}).get(ADMITTED_BY)
        job.metadata.annotations = annotations if prior is None else {**annotations, ADMITTED_BY: prior}
        return
    if token is None:
        job.metadata.annotations = {**annotations, ADMITTED_BY: ADMIN}
        return
    policy, policy_name = policies.for_namespace(job.metadata.namespace)
    label = describe(policy_name)
    problems = violations(job.spec, policy) + _quota_problems(store, policy, job, current)
    if problems:
        causes = [{"field": f, "reason": "FieldValueForbidden", "message": f"{why} ({label})"} for f, why in problems]
        raise Forbidden(f'rolloutjobs.rolloutd.io "{job.metadata.name}" is forbidden by {label} of namespace '
                        f'{job.metadata.namespace!r}: ' + "; ".join(f"{f}: {why}" for f, why in problems),
                        causes=causes, name=job.metadata.name)
    job.metadata.annotations = {**annotations, ADMITTED_BY: token.name}


def _namespace_lock(namespace: str) -> threading.Lock:
    with _NS_LOCKS_GUARD:
        return _NS_LOCKS.setdefault(namespace, threading.Lock())


def admit_and_write(request: Request, store: Store, policies: Policies, job: RolloutJob,
                    current: dict[str, Any] | None, write: Callable[[], T]) -> T:
    """`admit` then `write()` with no other write of the namespace's jobs in between: the quota counts
    (jobs, nodes) hold under parallel requests. Runs in a worker thread (the count reads the database)."""
    with _namespace_lock(job.metadata.namespace):
        admit(request, store, policies, job, current)
        return write()
