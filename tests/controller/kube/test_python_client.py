"""The official `kubernetes` Python client's DynamicClient against the controller: discovery, create, list,
watch with resume, patch of the status subresource, and the errors it raises."""
from __future__ import annotations

import pytest
from support.kube_helpers import MERGE, NS, WATCH_HISTORY, job_doc

kubernetes = pytest.importorskip("kubernetes")
from kubernetes.dynamic import DynamicClient  # noqa: E402
from kubernetes.dynamic.exceptions import ApiException  # noqa: E402


@pytest.fixture(scope="module")
def rj(kube):
    api_client = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))
    with api_client:
        client = DynamicClient(api_client)
        yield client.resources.get(api_version="rolloutd.io/v1alpha1", kind="RolloutJob")


def test_discovery_names_the_resource(rj):
    assert rj.namespaced and rj.name == "rolloutjobs" and "rj" in rj.short_names
    assert "status" in rj.subresources and rj.subresources["status"].verbs == ["get", "patch", "update"]


def test_create_list_and_patch_status(rj):
    created = rj.create(body=job_doc("py-job", team="py"), namespace="py")
    assert created.metadata.namespace == "py" and created.metadata.uid and created.status.phase == "Pending"
    listed = rj.get(namespace="py", label_selector="team=py")
    assert [i.metadata.name for i in listed.items] == ["py-job"]
    patched = rj.status.patch(name="py-job", namespace="py", content_type="application/merge-patch+json",
                              body={"status": {"phase": "Running", "nodes": 2}})
    assert patched.status.phase == "Running" and patched.status.nodes == 2
    assert patched.metadata.generation == created.metadata.generation  # a status write is no spec change
    assert int(patched.metadata.resourceVersion) > int(created.metadata.resourceVersion)
    with pytest.raises(ApiException) as err:
        rj.create(body=job_doc("py-job"), namespace="py")
    assert err.value.status == 409


def test_watch_resumes_from_a_resource_version(rj):
    rj.create(body=job_doc("py-watch"), namespace="py")
    listing = rj.get(namespace="py")
    resume_from = listing.metadata.resourceVersion
    for phase in ("Provisioning", "Running"):
        rj.status.patch(name="py-watch", namespace="py", content_type="application/merge-patch+json",
                        body={"status": {"phase": phase}})
    seen = []  # the reconciler may write the job too (its conditions): every change after resume_from, once
    for event in rj.watch(namespace="py", resource_version=resume_from, timeout=10):
        obj = event["object"]
        seen.append((event["type"], int(obj.metadata.resourceVersion), obj.metadata.name, obj.status.phase))
        if obj.metadata.name == "py-watch" and obj.status.phase == "Running":
            break
    versions = [rv for _, rv, _, _ in seen]
    assert versions == sorted(set(versions)) and versions[0] > int(resume_from)
    assert {t for t, *_ in seen} == {"MODIFIED"}
    phases = [p for _, _, name, p in seen if name == "py-watch"]
    assert phases.index("Provisioning") < phases.index("Running")


def test_watch_past_the_kept_window_is_410(kube, rj):
    rj.create(body=job_doc("py-busy"), namespace="py")
    with kube.client() as api:
        for i in range(WATCH_HISTORY * 3 // 2 + 10):  # enough changes for the log to be trimmed past version 1
            r = api.patch(f"{NS}/py/rolloutjobs/py-busy", json={"metadata": {"labels": {"n": str(i)}}}, headers=MERGE)
            assert r.status_code == 200, r.text
    with pytest.raises(ApiException) as err:
        for _ in rj.watch(namespace="py", resource_version="1", timeout=5):
            pass
    assert err.value.status == 410
