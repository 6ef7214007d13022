"""The Kubernetes API on the wire: discovery, OpenAPI, list paging, Table, watch, patches, options and errors."""
from __future__ import annotations

import json

import yaml
from support.kube_helpers import MERGE, NS, job_doc

from rolloutd.crds.crd import build_crd

APPLY = {"Content-Type": "application/apply-patch+yaml"}
JSON_PATCH = {"Content-Type": "application/json-patch+json"}
TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"}


def test_discovery(kube):
    with kube.client() as api:
        assert api.get("/version").json()["major"] == "1"
        assert api.get("/api").json()["versions"] == ["v1"]
        core = {r["name"]: r for r in api.get("/api/v1").json()["resources"]}
        assert core["namespaces"]["namespaced"] is False and core["events"]["namespaced"] is True
        groups = api.get("/apis").json()["groups"]
        assert [g["name"] for g in groups] == ["rolloutd.io"]
        assert groups[0]["preferredVersion"]["groupVersion"] == "rolloutd.io/v1alpha1"
        res = {r["name"]: r for r in api.get("/apis/rolloutd.io/v1alpha1").json()["resources"]}
        rj = res["rolloutjobs"]
        assert rj["kind"] == "RolloutJob" and rj["namespaced"] and rj["shortNames"] == ["rj"]
        assert rj["categories"] == ["rolloutd"] and set(rj["verbs"]) >= {"create", "get", "list", "watch", "patch",
                                                                           "update", "delete"}
        assert res["rolloutjobs/status"]["verbs"] == ["get", "patch", "update"]


def test_openapi_comes_from_the_crd_models(kube):
    crd_schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    with kube.client() as api:
        root = api.get("/openapi/v3").json()["paths"]
        doc = api.get(root["apis/rolloutd.io/v1alpha1"]["serverRelativeURL"]).json()
        job = doc["components"]["schemas"]["io.rolloutd.v1alpha1.RolloutJob"]
        assert job["x-kubernetes-group-version-kind"] == [
            {"group": "rolloutd.io", "version": "v1alpha1", "kind": "RolloutJob"}]
        assert job["properties"]["spec"] == crd_schema["properties"]["spec"]
        assert job["properties"]["status"] == crd_schema["properties"]["status"]
        patch = doc["paths"]["/apis/rolloutd.io/v1alpha1/namespaces/{namespace}/rolloutjobs/{name}"]["patch"]
        assert {"fieldValidation", "dryRun", "fieldManager", "force"} <= {p["name"] for p in patch["parameters"]}
        v2 = api.get("/openapi/v2").json()
        assert v2["swagger"] == "2.0" and v2["definitions"]["io.rolloutd.v1alpha1.RolloutJob"]["properties"]["spec"] \
            == crd_schema["properties"]["spec"]


def test_list_pages_and_table(kube):
    with kube.client() as api:
        for i in range(5):
            assert api.post(f"{NS}/paged/rolloutjobs", json=job_doc(f"page-{i}", tier="paged")).status_code == 201
        names, cont, rvs = [], None, set()
        while True:
            params = {"limit": 2, "labelSelector": "tier=paged", **({"continue": cont} if cont else {})}
            page = api.get(f"{NS}/paged/rolloutjobs", params=params).json()
            names += [i["metadata"]["name"] for i in page["items"]]
            rvs.add(page["metadata"]["resourceVersion"])
            cont = page["metadata"].get("continue")
            if not cont:
                break
        assert names == [f"page-{i}" for i in range(5)] and len(rvs) == 1  # one snapshot's version for all pages
        table = api.get(f"{NS}/paged/rolloutjobs", headers=TABLE).json()
        assert table["kind"] == "Table" and [c["name"] for c in table["columnDefinitions"]][:2] == ["Name", "Phase"]
        assert table["rows"][0]["cells"][:2] == ["page-0", "Pending"]
        assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
        r = api.get(f"{NS}/paged/rolloutjobs", params={"fieldSelector": "metadata.name=page-3"})
        assert [i["metadata"]["name"] for i in r.json()["items"]] == ["page-3"]


def test_watch_streams_json_lines_with_bookmarks(kube):
    with kube.client() as api:
        api.post(f"{NS}/watched/rolloutjobs", json=job_doc("wl"))
        rv = api.get(f"{NS}/watched/rolloutjobs").json()["metadata"]["resourceVersion"]
        api.patch(f"{NS}/watched/rolloutjobs/wl", json={"metadata": {"labels": {"seen": "yes"}}}, headers=MERGE)
        r = api.get(f"{NS}/watched/rolloutjobs", params={"watch": "true", "resourceVersion": rv,
                                                          "timeoutSeconds": "1", "allowWatchBookmarks": "true"},
                    headers={"Accept": "application/json"})
        events = [json.loads(line) for line in r.text.splitlines()]
        assert r.headers["content-type"].startswith("application/json")
        modified = [e for e in events if e["type"] == "MODIFIED" and e["object"]["metadata"]["name"] == "wl"]
        assert modified and modified[-1]["object"]["metadata"]["labels"]["seen"] == "yes"
        fresh = api.get(f"{NS}/watched/rolloutjobs", params={"watch": "true", "timeoutSeconds": "1",
                                                              "sendInitialEvents": "true", "allowWatchBookmarks": "true"},
                        headers={"Accept": "application/json"})
        first = [json.loads(line) for line in fresh.text.splitlines()]
        assert first[0]["type"] == "ADDED" and first[1]["type"] == "BOOKMARK"
        assert first[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_update_patch_and_server_side_apply(kube):
    with kube.client() as api:
        base = f"{NS}/writes/rolloutjobs"
        api.post(base, json=job_doc("w"))
        for _ in range(5):  # read-modify-write, as clients do: the reconciler may write in between (409, again)
            current = api.get(f"{base}/w").json()
            stale = {**current, "metadata": {**current["metadata"], "labels": {"x": "1"}}}
            if (updated := api.put(f"{base}/w", json=stale)).status_code != 409:
                break
        assert updated.status_code == 200 and updated.json()["metadata"]["labels"] == {"x": "1"}
        conflict = api.put(f"{base}/w", json=stale)  # the same resourceVersion again: stale now
        assert conflict.status_code == 409 and conflict.json()["reason"] == "Conflict"
        ops = [{"op": "replace", "path": "/spec/executor/nodes", "value": 4}]
        assert api.patch(f"{base}/w", json=ops, headers=JSON_PATCH).json()["spec"]["executor"]["nodes"] == 4
        intent = yaml.safe_dump({"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob",
                                 "metadata": {"name": "w", "labels": {"owner": "ops"}}})
        applied = api.patch(f"{base}/w", params={"fieldManager": "ops"}, content=intent, headers=APPLY).json()
        managers = {m["manager"]: m for m in applied["metadata"]["managedFields"]}
        assert managers["ops"]["operation"] == "Apply" and "f:owner" in json.dumps(managers["ops"]["fieldsV1"])
        dropped = yaml.safe_dump({"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "w"}})
        after = api.patch(f"{base}/w", params={"fieldManager": "ops"}, content=dropped, headers=APPLY).json()
        assert "owner" not in after["metadata"].get("labels", {})  # a field dropped from the intent is removed
        dry = api.patch(f"{base}/w", params={"dryRun": "All"}, json={"spec": {"executor": {"nodes": 7}}}, headers=MERGE)
        assert dry.status_code == 200 and dry.json()["spec"]["executor"]["nodes"] == 7
        assert api.get(f"{base}/w").json()["spec"]["executor"]["nodes"] == 4


def test_field_validation_modes(kube):
    with kube.client() as api:
        base = f"{NS}/fv/rolloutjobs"
        doc = job_doc("fv")
        doc["spec"]["agent"]["maxTurn"] = 3
        strict = api.post(base, json=doc, params={"fieldValidation": "Strict"})
        assert strict.status_code == 422 and strict.json()["details"]["causes"][0]["field"] == "spec.agent.maxTurn"
        warned = api.post(base, json=doc, params={"fieldValidation": "Warn", "dryRun": "All"})
        assert warned.status_code == 201 and 'unknown field \\"spec.agent.maxTurn\\"' not in warned.headers["warning"]
        assert "spec.agent.maxTurn" in warned.headers["warning"] and "maxTurn" not in warned.json()["spec"]["agent"]
        ignored = api.post(base, json=doc, params={"fieldValidation": "Ignore"})
        assert ignored.status_code == 201 and "warning" not in ignored.headers


def test_bad_input_is_a_4xx_status_never_5xx(kube):
    base = f"{NS}/bad/rolloutjobs"
    with kube.client() as api:
        api.post(base, json=job_doc("b"))
        cases = [
            (api.get(base, params={"limit": "-1"}), 400),
            (api.get(base, params={"continue": "not-a-token"}), 400),
            (api.get(base, params={"fieldSelector": "spec.tasks.kind=math"}), 400),
            (api.get(base, params={"labelSelector": "a in (b"}), 400),
            (api.post(base, json=job_doc("b"), params={"dryRun": "Some"}), 400),
            (api.post(base, json=job_doc("b"), params={"fieldValidation": "Loose"}), 400),
            (api.post(f"{NS}/other/rolloutjobs", json={**job_doc("c"), "metadata": {"name": "c", "namespace": "x"}}), 400),
            (api.get(f"{NS}/Not_A_Namespace/rolloutjobs/b"), 404),
            (api.patch(f"{base}/b", content="{}", headers={"Content-Type": "application/strategic-merge-patch+json"}), 415),
            (api.patch(f"{base}/b", json=[{"op": "replace", "path": "/nope/deeper", "value": 1}], headers=JSON_PATCH), 422),
            (api.patch(f"{base}/b", json={"op": "x"}, headers=JSON_PATCH), 400),
            (api.patch(f"{base}/b", content="kind: RolloutJob", headers=APPLY), 400),  # no fieldManager
            (api.patch(f"{base}/b", json={}, params={"force": "true"}, headers=MERGE), 400),
            (api.patch(f"{base}/b", json={"spec": {"samplesPerPrompt": "many"}}, headers=MERGE), 422),
            (api.patch(f"{base}/b/status", json={"status": {"phase": "Dancing"}}, headers=MERGE), 422),
            (api.patch(f"{base}/b", content=b"{\xff", headers=MERGE), 400),
            (api.request("DELETE", f"{base}/b", content=json.dumps({"preconditions": {"uid": "other"}})), 409),
            (api.request("DELETE", f"{base}/b", content="[1]"), 400),
            (api.get("/openapi/v3/apis/nope/v1"), 404),
            (api.post(base, json=job_doc("b")), 409),  # a name is unique within its namespace
        ]
        for response, code in cases:
            assert response.status_code == code, (response.request.method, response.request.url, response.text)
            body = response.json()
            assert body["kind"] == "Status" and body["code"] == code and body["message"]
        assert 'rolloutjobs "b" already exists' in cases[-1][0].json()["message"]


def test_a_label_selected_watch_sees_an_object_leave_and_come_back(kube):
    """As Kubernetes filters a watch: an object that stops matching the selector is DELETED for the watcher,
    one that starts matching is ADDED; a job that never matches is never seen (from a list and from a resume)."""
    with kube.client() as api:
        base = f"{NS}/selected/rolloutjobs"
        api.post(base, json={**job_doc("ls"), "metadata": {"name": "ls", "labels": {"tier": "a"}}})
        api.post(base, json={**job_doc("other"), "metadata": {"name": "other", "labels": {"tier": "z"}}})
        rv = api.get(base).json()["metadata"]["resourceVersion"]
        for tier in ("b", "a"):
            api.patch(f"{base}/ls", json={"metadata": {"labels": {"tier": tier}}}, headers=MERGE)
        api.patch(f"{base}/ls", json={"metadata": {"labels": {"more": "1"}}}, headers=MERGE)
        api.patch(f"{base}/other", json={"metadata": {"labels": {"more": "1"}}}, headers=MERGE)
        for since in ({"resourceVersion": rv}, {}):
            r = api.get(base, params={"watch": "true", "timeoutSeconds": "1", "labelSelector": "tier=a", **since},
                        headers={"Accept": "application/json"})
            events = [json.loads(line) for line in r.text.splitlines()]
            assert {e["object"]["metadata"]["name"] for e in events} == {"ls"}, events
            kinds = [e["type"] for e in events]
            if since:  # resumed: the object leaves (DELETED, carrying tier=b), comes back (ADDED), then changes
                gone = kinds.index("DELETED")
                assert events[gone]["object"]["metadata"]["labels"]["tier"] == "b"
                assert kinds[gone + 1] == "ADDED" and set(kinds[gone + 2:]) == {"MODIFIED"}
                assert set(kinds[:gone]) <= {"MODIFIED"}
            else:  # from the current state: one ADDED, then only MODIFIED
                assert kinds[0] == "ADDED" and set(kinds[1:]) <= {"MODIFIED"}
