"""Helpers of the Kubernetes-API tests: the example job under another name (and as a tenant may apply it, with
the TenantPolicy that lets it), and a status write as an operator makes it. Where kubectl is: tests/support/kube_tools.py."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import yaml
from support.example_job import example_doc

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math-demo.yaml"
NS = "/apis/rolloutd.io/v1alpha1/namespaces"
MERGE = {"Content-Type": "application/merge-patch+json"}
WATCH_HISTORY = 100  # changes the test controller keeps for resuming watches (ROLLOUTD_WATCH_HISTORY)


def _tenant_data() -> Path:
    """A world-readable copy of the example dataset: a tenant's reads are nobody's (crds/kit/safe_read.py), and the
    checkout may lie below a directory only root can enter."""
    root = Path(tempfile.mkdtemp(prefix="rolloutd-tenant-data-", dir="/tmp"))
    root.chmod(0o755)
    shutil.copy(EXAMPLE.parent / "math" / "train.jsonl", root / "train.jsonl")
    (root / "train.jsonl").chmod(0o644)
    atexit.register(shutil.rmtree, root, True)
    return root


TENANT_DATA = _tenant_data()



def job_doc(name: str, **labels: str) -> dict:
    doc = example_doc()
    doc["metadata"]["name"] = name
    doc["metadata"].setdefault("labels", {}).update(labels)
    return doc


EXAMPLE_BACKEND = "http://127.0.0.1:8000"  # the example job's llm.backends


def tenant_job_doc(name: str, **labels: str) -> dict:
    """`job_doc` as a namespace token may apply it under `tenant_policy`: its dataset named by absolute path."""
    doc = job_doc(name, **labels)
    doc["spec"]["tasks"]["source"] = str(TENANT_DATA / "train.jsonl")
    return doc


def tenant_policy(namespace: str, **spec) -> dict:
    """A TenantPolicy letting `namespace`'s tokens apply `tenant_job_doc` (its data root is the examples, its
    backend the example's: a policy's backend list is explicit, empty allows none)."""
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "TenantPolicy", "metadata": {"name": namespace},
            "spec": {"dataRoots": [str(TENANT_DATA)], "backends": [EXAMPLE_BACKEND], "quotas": {"jobs": 64, "nodes": 64},
                     **spec}}


def job_yaml(name: str, **labels: str) -> str:
    return yaml.safe_dump(job_doc(name, **labels))


def set_status(api, name: str, status: dict, namespace: str = "default") -> dict:
    """A merge patch of the status subresource (what the reconciler does), through `api` (an httpx client)."""
    r = api.patch(f"{NS}/{namespace}/rolloutjobs/{name}/status", json={"status": status}, headers=MERGE)
    assert r.status_code == 200, r.text
    return r.json()
