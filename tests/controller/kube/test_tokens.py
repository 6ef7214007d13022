"""Scoped tokens: a read-only token reads and watches but every write verb is a 403 Status; a namespace token
stays in its namespaces (cluster-wide calls and other namespaces: 403); `rolloutd token create` writes 0600 files."""
from __future__ import annotations

import stat

import pytest
from fastapi.testclient import TestClient
from support.kube_helpers import job_doc, tenant_job_doc, tenant_policy
from typer.testing import CliRunner

from rolloutd.controller.api import create_app
from rolloutd.controller.root import assemble
from rolloutd.controller.access.auth import TokenBook, create_scoped_token
from rolloutd.controller.main import app as rolloutd_cli
from rolloutd.controller.store import Store

P = "/apis/rolloutd.io/v1alpha1"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
def api(tmp_path):
    tokens = tmp_path / "tokens"
    scoped = {
        "dash": create_scoped_token(tokens, "dash", read_only=True, namespaces=[]).token,
        "team": create_scoped_token(tokens, "team", read_only=False, namespaces=["team-a"]).token,
        "team-ro": create_scoped_token(tokens, "team-ro", read_only=True, namespaces=["team-a"]).token,
    }
    app = create_app(assemble(Store(tmp_path / "rolloutd.db"), "admin-secret", tokens=TokenBook(tokens)))
    with TestClient(app) as client:
        def call(token: str, method: str, path: str, **kw):
            return client.request(method, path, headers={"Authorization": f"Bearer {scoped.get(token, token)}",
                                                         **kw.pop("headers", {})}, **kw)
        for ns in ("default", "team-a"):
            assert call("admin-secret", "POST", f"{P}/namespaces/{ns}/rolloutjobs", json=job_doc("j")).status_code == 201
        # team-a's jobs are held to its TenantPolicy (the restricted profile allows no dataset at all)
        assert call("admin-secret", "PUT", f"{P}/tenantpolicies/team-a", json=tenant_policy("team-a")).status_code == 201
        call.tokens_dir = tokens
        yield call


def _forbidden(response, *words: str) -> None:
    assert response.status_code == 403, response.text
    body = response.json()
    assert (body["kind"], body["reason"], body["code"]) == ("Status", "Forbidden", 403)
    assert all(w in body["message"] for w in words), body["message"]


def test_a_read_only_token_reads_and_watches_but_every_write_verb_is_forbidden(api):
    job = f"{P}/namespaces/default/rolloutjobs/j"
    assert api("dash", "GET", f"{P}/rolloutjobs").json()["items"]
    assert api("dash", "GET", job).json()["metadata"]["name"] == "j"
    watch = api("dash", "GET", f"{P}/namespaces/default/rolloutjobs",
                params={"watch": "true", "resourceVersion": "0", "timeoutSeconds": "1"})
    assert watch.status_code == 200 and '"ADDED"' in watch.text
    assert api("dash", "GET", "/version").status_code == 200 and api("dash", "GET", "/metrics").status_code == 200
    writes = [("POST", f"{P}/namespaces/default/rolloutjobs", {"json": job_doc("k")}),
              ("POST", f"{P}/rolloutjobs", {"json": job_doc("k")}),
              ("PUT", job, {"json": job_doc("j")}),
              ("PUT", f"{P}/rolloutjobs/j", {"json": job_doc("j")}),
              ("PATCH", job, {"json": {"metadata": {"labels": {"a": "b"}}}, "headers": MERGE}),
              ("PATCH", f"{job}/status", {"json": {"status": {"phase": "Failed"}}, "headers": MERGE}),
              ("DELETE", job, {}),
              ("POST", f"{job}/batches", {"json": {}}),
              ("POST", f"{job}/policy", {"json": {"version": 2}}),
              ("DELETE", f"{job}/backends", {"params": {"url": "http://x"}})]
    for method, path, kw in writes:
        _forbidden(api("dash", method, path, **kw), 'token "dash" is read-only')
    assert "a" not in api("admin-secret", "GET", job).json()["metadata"]["labels"]  # nothing was written
    assert api("admin-secret", "GET", job).json()["metadata"].get("deletionTimestamp") is None


def test_a_namespace_token_stays_in_its_namespaces(api):
    own, other = f"{P}/namespaces/team-a/rolloutjobs", f"{P}/namespaces/default/rolloutjobs"
    assert api("team", "GET", own).json()["items"][0]["metadata"]["namespace"] == "team-a"
    assert api("team", "POST", own, json=tenant_job_doc("k")).status_code == 201
    assert api("team", "PATCH", f"{own}/k", json={"metadata": {"labels": {"a": "b"}}}, headers=MERGE).status_code == 200
    assert api("team", "DELETE", f"{own}/k").status_code == 200
    assert api("team", "GET", f"{P}/namespaces/team-a/rolloutjobs/j/events").status_code == 200
    assert api("team", "GET", "/api/v1/namespaces/team-a/events").status_code == 200
    assert api("team", "GET", f"{P}").status_code == 200  # discovery: kubectl starts there
    for method, path, kw in [("GET", other, {}), ("GET", f"{other}/j", {}), ("POST", other, {"json": job_doc("x")}),
                             ("DELETE", f"{other}/j", {}), ("GET", "/api/v1/namespaces/default/events", {}),
                             ("GET", f"{P}/rolloutjobs/j", {})]:  # the path without a namespace is `default`'s
        _forbidden(api("team", method, path, **kw), 'in the namespace "default"')
    for method, path, kw in [("GET", f"{P}/rolloutjobs", {}), ("POST", f"{P}/rolloutjobs", {"json": job_doc("x")}),
                             ("GET", "/metrics", {}), ("GET", "/api/v1/namespaces", {})]:
        _forbidden(api("team", method, path, **kw), "cluster scope")
    _forbidden(api("team-ro", "DELETE", f"{own}/j"), "read-only")
    assert api("team-ro", "GET", f"{own}/j").status_code == 200


def test_an_unknown_token_is_401_and_deleting_a_token_file_revokes_it(api):
    assert api("not-a-token", "GET", f"{P}/rolloutjobs").status_code == 401
    (api.tokens_dir / "dash.json").unlink()
    assert api("dash", "GET", f"{P}/rolloutjobs").status_code == 401
    assert api("team", "GET", f"{P}/namespaces/team-a/rolloutjobs").status_code == 200


def test_token_create_writes_0600_files_and_refuses_a_bad_name_or_a_second_token_of_a_name(tmp_path):
    run = CliRunner().invoke
    out = tmp_path / "dash.token"
    result = run(rolloutd_cli, ["token", "create", "dash", "--read-only", "-n", "team-a", "--data-dir", str(tmp_path),
                                "-o", str(out)])
    assert result.exit_code == 0, result.output
    book = TokenBook(tmp_path / "tokens")
    scoped = book.find(f"Bearer {out.read_text().strip()}")
    assert (scoped.name, scoped.read_only, scoped.namespaces) == ("dash", True, ("team-a",))
    for path in (out, tmp_path / "tokens" / "dash.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "tokens").stat().st_mode) == 0o700
    again = run(rolloutd_cli, ["token", "create", "dash", "--data-dir", str(tmp_path)])
    assert again.exit_code == 2 and "exists" in again.output
    bad = run(rolloutd_cli, ["token", "create", "Bad_Name", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "token name" in bad.output
