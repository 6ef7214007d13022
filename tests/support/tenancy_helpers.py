"""Helpers of the tenancy suite (tests/tenancy): a tenant's client with a real namespace token, the example job
as a tenant applies it, the admin's policy write, and the check that a refusal names the field and the policy.
The fixtures (a real controller per module) are conftest.py's."""
from __future__ import annotations

import copy

import httpx
from support.kube_controller import kubectl_for  # noqa: F401 - the tenancy tests' kubectl, one for all folders
from support.kube_helpers import tenant_job_doc, tenant_policy

from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.crds.kit.paths import DataDir

P = "/apis/rolloutd.io/v1alpha1"
POLICIES = f"{P}/tenantpolicies"
ADMITTED_BY = "rolloutd.io/admitted-by"
MERGE = {"Content-Type": "application/merge-patch+json"}


def tenant(kube, namespace: str, name: str | None = None) -> httpx.Client:
    """A client holding a fresh namespace token for `namespace` (a tenant's)."""
    token = create_scoped_token(DataDir(kube.data_dir).tokens, name or f"tok-{namespace}", read_only=False,
                                namespaces=[namespace]).token
    return kube.client(token)


def merged(base: dict, change: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in change.items():
        out[k] = merged(out.get(k) or {}, v) if isinstance(v, dict) and not k.endswith("env") else v
    return out


def job(name: str, **spec_change) -> dict:
    """The example job as a tenant applies it (dataset by absolute path), with `spec_change` merged into spec."""
    doc = tenant_job_doc(name)
    doc["spec"] = merged(doc["spec"], spec_change)
    return doc


def put_policy(admin: httpx.Client, namespace: str, **spec) -> dict:
    r = admin.put(f"{POLICIES}/{namespace}", json=tenant_policy(namespace, **spec))
    assert r.status_code in (200, 201), r.text
    return r.json()


def jobs_path(namespace: str) -> str:
    return f"{P}/namespaces/{namespace}/rolloutjobs"


def refused(r: httpx.Response, field: str, policy: str, code: int = 403) -> dict:
    """`r` is a Kubernetes Status refusing the write, naming `field` among its causes and `policy` in its message."""
    assert r.status_code == code, r.text
    body = r.json()
    assert body["kind"] == "Status" and body["code"] == code, body
    fields = [c["field"] for c in body["details"].get("causes", [])]
    assert field in fields, (field, fields)
    assert policy in body["message"], body["message"]
    assert all(policy in c["message"] for c in body["details"]["causes"]), body
    return body
