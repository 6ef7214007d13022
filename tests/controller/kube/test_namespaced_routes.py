"""One job name in two namespaces: the trainer routes and the node protocol under
/namespaces/{ns}/rolloutjobs/{name}/… reach each job's own work; the previous version's paths mean `default`."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support.kube_helpers import job_doc

from rolloutd.controller.api import create_app
from rolloutd.controller.access.auth import TokenBook, create_scoped_token
from rolloutd.controller.access.nodeauth import NodeCredentials
from rolloutd.controller.store import Store
from rolloutd.controller.root import assemble
from rolloutd.crds.node import NODE_PROTOCOL

P = "/apis/rolloutd.io/v1alpha1"
TEAM, DEFAULT = f"{P}/namespaces/team-a/rolloutjobs/j", f"{P}/namespaces/default/rolloutjobs/j"


@pytest.fixture
def setup(tmp_path):
    store = Store(tmp_path / "rolloutd.db")
    team = create_scoped_token(tmp_path / "tokens", "team", read_only=False, namespaces=["team-a"]).token
    creds = NodeCredentials(None)
    root = assemble(store, "admin", credentials=creds, tokens=TokenBook(tmp_path / "tokens"), work={})
    scheduler, app = root.scheduler, create_app(root)
    with TestClient(app, headers={"Authorization": "Bearer admin"}) as api:
        for ns in ("default", "team-a"):
            assert api.post(f"{P}/namespaces/{ns}/rolloutjobs", json=job_doc("j")).status_code == 201
        api.team_token = team
        api.creds = {key: creds.mint(store.get(key)) for key in ("j", "team-a/j")}  # as the executors do
        yield api, scheduler


def _register(api, path: str, job: str, name: str = "n1", cred: str = "team-a/j"):
    return api.post(path + "?features=node-token", json={"job": job, "name": name, "protocol": NODE_PROTOCOL},
                    headers={"Authorization": f"Bearer {api.creds[cred]}"})


def _as(reg) -> dict[str, str]:
    return {"Authorization": f"Bearer {reg.json()['nodeToken']}"}


def test_the_node_protocol_under_the_job_registers_with_that_namespace_s_job(setup):
    api, scheduler = setup
    reg = _register(api, f"{TEAM}/nodes/register", "j")
    assert reg.status_code == 200, reg.text
    node = reg.json()["nodeId"]
    assert [n.id for n in scheduler.work.registry.nodes("team-a/j")] == [node] and scheduler.work.registry.nodes("j") == []
    assert api.post(f"{TEAM}/nodes/{node}/heartbeat", json={}, headers=_as(reg)).status_code == 200
    refused = _register(api, f"{TEAM}/nodes/register", "other")
    assert refused.status_code == 400 and "team-a/j" in refused.json()["message"]
    old = _register(api, f"{P}/nodes/register", "team-a/j", "n2")  # a daemon of the previous version, by key
    assert old.status_code == 200 and len(scheduler.work.registry.nodes("team-a/j")) == 2
    assert _register(api, f"{P}/nodes/register", "j", "n3").status_code == 403  # team-a's credential: not default's
    assert _register(api, f"{P}/nodes/register", "j", "n3", cred="j").status_code == 200  # a bare name: `default`
    assert [n.name for n in scheduler.work.registry.nodes("j")] == ["n3"]
    assert api.post(f"{TEAM}/nodes/register", json={"job": "j", "name": "x", "protocol": NODE_PROTOCOL}).status_code == 200
    node_creds = {"Authorization": f"Bearer {api.creds['team-a/j']}"}
    assert api.get(TEAM, headers=node_creds).status_code == 401  # a node credential: nodes/ only


def test_the_trainer_routes_of_one_namespace_leave_the_other_s_job_alone(setup):
    api, _ = setup
    added = api.post(f"{TEAM}/backends", json={"url": "http://127.0.0.1:9100"})
    assert added.status_code == 200, added.text
    urls = lambda path: [b["url"] for b in api.get(f"{path}/backends").json()["items"]]  # noqa: E731
    assert "http://127.0.0.1:9100" in urls(TEAM) and "http://127.0.0.1:9100" not in urls(DEFAULT)
    assert urls(f"{P}/rolloutjobs/j") == urls(DEFAULT)  # the path without a namespace is `default`'s
    assert api.post(f"{TEAM}/policy", json={"version": 7}).json()["version"] == 7
    assert api.get(f"{DEFAULT}/policy").json()["version"] != 7
    for path in (TEAM, DEFAULT):
        assert api.get(f"{path}/trajectories").status_code == 200 and api.get(f"{path}/groups").status_code == 200
        assert api.get(f"{path}/events").status_code == 200
    assert api.get(f"{P}/namespaces/nope/rolloutjobs/j/policy").status_code == 404


def test_a_namespaced_node_path_acts_only_on_that_job_s_nodes(setup):
    """Naming a `default` node's id on team-a's node paths must not lease, beat, report, give back or
    deregister for it (the node untouched): the admin gets 404, the node's own token 401 there, a team-a
    token 403 (namespace tokens never speak the node protocol)."""
    api, scheduler = setup
    reg = _register(api, f"{DEFAULT}/nodes/register", "j", cred="j")
    node = reg.json()["nodeId"]
    team = {"Authorization": f"Bearer {api.team_token}"}
    calls = {"lease": {"maxItems": 1}, "heartbeat": {}, "results": {"results": []},
             "return": {"attemptIds": [], "reason": "x"}, "deregister": None}
    for verb, body in calls.items():
        for headers, code in ((team, 403), (_as(reg), 401), ({}, 404)):
            r = api.post(f"{TEAM}/nodes/{node}/{verb}", json=body, headers=headers)  # {}: the admin's
            assert r.status_code == code, (verb, r.text)
            assert code != 404 or "team-a/j" in r.json()["message"]
    assert [n.id for n in scheduler.work.registry.nodes("j")] == [node] and scheduler.work.registry.nodes("j")[0].state == "active"
    own = api.post(f"{DEFAULT}/nodes/{node}/heartbeat", json={}, headers=_as(reg))
    assert own.status_code == 200, own.text
    assert api.post(f"{P}/nodes/{node}/heartbeat", json={}, headers=team).status_code == 403  # cluster scope
