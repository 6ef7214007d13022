"""Tenant admission of RolloutJob writes, the analogue of Pod Security Admission and ResourceQuota.

Called by every RolloutJob write route (`jobs.py`: create, replace, patch, server-side apply, rolloutctl's
apply, on the namespaced and the old paths) after the body validated, and by the watch route for the watch
quota. A write made with a scoped token is checked against its namespace's TenantPolicy (or the restricted
profile) with `crds.tenancy.violations` plus the quotas only the controller can count (jobs and nodes of the
namespace); any refusal is one 403 Forbidden naming every field and the policy. The server sets
`metadata.annotations[ADMITTED_BY]` on every write, never from the client: the scoped token's name, or "admin",
for whoever wrote the spec; a write that leaves the spec as it was (labels, the operator's annotations) asks
for nothing new and keeps the previous writer, so touching a tenant's job never lifts its policy and an
operator's scoped token may annotate any job. Next step: the items quota at expansion.
"""
from __future__ import annotations

import weakref
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from rolloutd.crds.names import TERMINAL_PHASES
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.tenancy import ADMITTED_BY, RESTRICTED, TenantPolicySpec, violations

from ..auth import ScopedToken
from ..errors import Forbidden, TooManyRequests
from ..spec_checks import check_dataset
from ..store import Store
from ..tenancy import ADMIN, describe, policies_for

TOKEN_KEY = "rolloutd.token"  # the ASGI scope key where the API middleware leaves a scoped token (`api.py`)


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


def admit(request: Request, store: Store, job: RolloutJob, current: dict[str, Any] | None) -> None:
    """Check `job` (about to be stored; `current`: the stored one, None on create) and stamp ADMITTED_BY;
    403 Forbidden naming each field and the policy when a scoped token asks for more than it may."""
    _admit(request, store, job, current)
    if current is None and scoped_token(request) is None:
        check_dataset(job)  # the admin's new job: a dataset the controller cannot read is a 422 now, not a failure later


def _admit(request: Request, store: Store, job: RolloutJob, current: dict[str, Any] | None) -> None:
    token = scoped_token(request)
    annotations = dict(job.metadata.annotations)
    annotations.pop(ADMITTED_BY, None)  # never the client's
    if current is not None and current.get("spec") == job.spec.wire():  # asks for nothing new: the writer stays
        prior = (current.get("metadata") or {}).get("annotations", {}).get(ADMITTED_BY)
        job.metadata.annotations = annotations if prior is None else {**annotations, ADMITTED_BY: prior}
        return
    if token is None:
        job.metadata.annotations = {**annotations, ADMITTED_BY: ADMIN}
        return
    policy, policy_name = policies_for(store).for_namespace(job.metadata.namespace)
    label = describe(policy_name)
    problems = violations(job.spec, policy) + _quota_problems(store, policy, job, current)
    if problems:
        causes = [{"field": f, "reason": "FieldValueForbidden", "message": f"{why} ({label})"} for f, why in problems]
        raise Forbidden(f'rolloutjobs.rolloutd.io "{job.metadata.name}" is forbidden by {label} of namespace '
                        f'{job.metadata.namespace!r}: ' + "; ".join(f"{f}: {why}" for f, why in problems),
                        causes=causes, name=job.metadata.name)
    job.metadata.annotations = {**annotations, ADMITTED_BY: token.name}


class _Counted:
    """A watch stream's body that gives its slot back once, however the stream ends (done, the client gone,
    or never started and collected)."""

    def __init__(self, inner: AsyncIterator[bytes], release: Callable[[], None]):
        self.inner = inner
        self._release = weakref.finalize(self, release)

    def __aiter__(self) -> "_Counted":
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.inner.__anext__()
        except BaseException:
            self._release()
            raise


def count_watch(request: Request, store: Store, namespace: str | None):
    """For a scoped token's watch: take one of the namespace's watch slots (quotas.watches; a watch of every
    namespace counts against the restricted profile's) or 429. Returns `wrap(response)`, which gives the slot
    back when the stream ends."""
    if scoped_token(request) is None:
        return lambda response: response
    policies = policies_for(store)
    key = namespace or ""
    policy, policy_name = policies.for_namespace(namespace) if namespace else (RESTRICTED, None)
    open_now = policies.take_watch(key, policy.quotas.watches)
    if open_now is not None:
        raise TooManyRequests(f"namespace {namespace or '(all)'!r} has {open_now} open watches, its quota "
                              f"(quotas.watches) is {policy.quotas.watches} ({describe(policy_name)}); close "
                              "one or ask the admin for more",
                              causes=[{"field": "watch", "reason": "FieldValueForbidden", "message": "over quota"}])

    def wrap(response):
        response.body_iterator = _Counted(response.body_iterator, lambda: policies.give_back_watch(key))
        return response
    return wrap
