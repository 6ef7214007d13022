"""What a scoped token may do: read-only tokens get, list and watch; namespace tokens stay in their namespaces;
TenantPolicies are the admin's (a scoped token reads at most its own namespaces' policies); a job's `status` is
the operator's (a namespace token reads it, as Kubernetes RBAC without `rolloutjobs/status` would).

Called by the API middleware (`middleware.py`) for a request carrying a scoped token (`auth.ScopedToken`); the
answer is None (allowed) or the message of a 403 Forbidden Status. The admin token never comes here; on node paths
a scoped token is refused before (`middleware.py`).
"""
from __future__ import annotations

import re

from rolloutd.crds.names import API_PREFIX, DEFAULT_NAMESPACE

from ..access.auth import ScopedToken

READ_METHODS = frozenset({"GET", "HEAD"})
VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
# Discovery and API documents: any valid token reads them (kubectl and the kubernetes client start there).
DISCOVERY = frozenset({"/version", "/api", "/api/v1", "/apis", "/apis/rolloutd.io", API_PREFIX, "/openapi.json",
                       "/openapi/v2", "/openapi/v3"})
_NAMESPACED = re.compile(rf"(?:{re.escape(API_PREFIX)}|/api/v1)/namespaces/([^/]+)(?:/.*)?")
_OLD_PER_JOB = re.compile(rf"{re.escape(API_PREFIX)}/rolloutjobs/[^/]+(?:/.*)?")  # the `default` namespace's
_STATUS = re.compile(rf"{re.escape(API_PREFIX)}/(?:namespaces/[^/]+/)?rolloutjobs/[^/]+/status/?")
_POLICIES = re.compile(rf"{re.escape(API_PREFIX)}/tenantpolicies(?:/([^/]+))?/?")  # the admin's (crds/tenancy.py)


def request_namespace(path: str) -> str | None:
    """The namespace a request acts in; None for a cluster-wide one (all namespaces, metrics)."""
    if m := _NAMESPACED.fullmatch(path):
        return m[1]
    if _OLD_PER_JOB.fullmatch(path):
        return DEFAULT_NAMESPACE
    return None


def forbidden(token: ScopedToken, method: str, path: str) -> str | None:
    """None when `token` may send `method path`, else why not (the 403's message)."""
    verb = VERBS.get(method, method.lower())
    who = f'token "{token.name}"'
    if token.read_only and method not in READ_METHODS:
        return f"{who} is read-only: it cannot {verb} ({method} {path})"
    if method in READ_METHODS and (path in DISCOVERY or path.startswith("/openapi/")):
        return None
    if m := _POLICIES.fullmatch(path):  # the admin's: a scoped token reads at most its namespaces' own
        mine = method in READ_METHODS and (not token.namespaces or (m[1] is not None and m[1] in token.namespaces))
        return None if mine else (f"{who} cannot {verb} TenantPolicies ({method} {path}): only the admin token "
                                  "manages them")
    if not token.namespaces:
        return None
    if method not in READ_METHODS and _STATUS.fullmatch(path):
        return (f"{who} cannot {verb} a RolloutJob's status ({method} {path}): the status is written by the "
                "operator only")
    namespace = request_namespace(path)
    if namespace is None:
        return (f"{who} is limited to the namespaces {', '.join(token.namespaces)}: it cannot {verb} at cluster "
                f"scope ({method} {path}); use /apis/rolloutd.io/v1alpha1/namespaces/<ns>/…")
    if namespace not in token.namespaces:
        return f'{who} cannot {verb} in the namespace "{namespace}" (it is limited to {", ".join(token.namespaces)})'
    return None
