"""A job's nodes on its page at scale: the live document carries the counts by state and the 50 nodes that most
need a look (not active, then the longest silent), not every node every second; the whole table comes a page at a
time from `…/nodes`, behind the same scope rule. A real controller (the test registers the nodes over the real
node protocol) and a real chromium for the page."""
from __future__ import annotations

import time

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from support.ui_protocol import NODE_PROTOCOL, P

NODES = 60


@pytest.fixture(scope="module")
def wide(cluster):
    """team-b/wide with NODES daemons; all but two of them called after a gap, so those two are the longest silent."""
    cluster.create_job("team-b", "wide", 1)  # registers node-wide
    ids = {"node-wide": cluster.nodes["team-b/wide"]}
    for i in range(NODES - 1):
        r = cluster.node_api.post(f"{P}/namespaces/team-b/rolloutjobs/wide/nodes/register",
                                  json={"job": "team-b/wide", "name": f"n{i:02d}", "host": f"h{i}",
                                        "protocol": NODE_PROTOCOL})
        assert r.status_code == 200, r.text
        ids[f"n{i:02d}"] = r.json()["nodeId"]
    time.sleep(1.5)  # the gap: a call made after it is later than every registration
    silent = {"n07", "n31"}
    for name, node in ids.items():
        if name not in silent:
            r = cluster.node_api.post(f"{P}/nodes/{node}/heartbeat", json={"stages": {}, "full": False})
            assert r.status_code == 200, r.text
    return {"names": set(ids), "silent": silent}


def test_the_live_document_shows_counts_and_the_nodes_that_most_need_a_look(cluster, wide):
    page = cluster.admin.get("/ui/api/jobs/team-b/wide").json()
    assert page["nodesTotal"] == NODES and page["nodeStates"] == {"active": NODES}
    shown = [n["name"] for n in page["nodes"]]
    assert len(shown) == 50 and len(set(shown)) == 50
    assert set(shown[:2]) == wide["silent"]  # the longest silent first
    assert page["nodes"][0]["secondsSinceBeat"] >= page["nodes"][2]["secondsSinceBeat"]


def test_every_node_comes_a_page_at_a_time_by_name(cluster, wide):
    got, offset = [], 0
    while True:
        r = cluster.admin.get("/ui/api/jobs/team-b/wide/nodes", params={"offset": offset, "limit": 25})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["total"] == NODES and body["offset"] == offset
        if not body["items"]:
            break
        got += [n["name"] for n in body["items"]]
        offset += 25
    assert got == sorted(wide["names"])
    assert {n["state"] for n in cluster.admin.get("/ui/api/jobs/team-b/wide/nodes").json()["items"]} == {"active"}


def test_the_nodes_route_keeps_the_scope_rule_and_names_bad_input(cluster, wide):
    with httpx.Client(base_url=cluster.controller.url, timeout=30,
                      headers={"Authorization": f"Bearer {cluster.scoped}"}) as team_a:
        r = team_a.get("/ui/api/jobs/team-b/wide/nodes")
        assert r.status_code == 403 and "team-b" in r.text  # another namespace's nodes: not even their count
    r = cluster.admin.get("/ui/api/jobs/team-b/nothing/nodes")
    assert r.status_code == 404 and "nothing" in r.text
    for bad in ({"limit": 0}, {"limit": 5000}, {"offset": -1}):
        r = cluster.admin.get("/ui/api/jobs/team-b/wide/nodes", params=bad)
        assert r.status_code == 422 and next(iter(bad)) in r.text


def test_the_page_says_how_many_and_links_to_all_of_them(cluster, wide, browser):
    url = cluster.controller.url
    browser.delete_all_cookies()
    browser.get(url + "/ui/login")
    browser.find_element(By.NAME, "token").send_keys(cluster.controller.token)
    browser.find_element(By.CSS_SELECTOR, "form#login button").click()
    WebDriverWait(browser, 20).until(lambda d: d.current_url.endswith("/ui/jobs"), "logged in")
    browser.get(url + "/ui/jobs/team-b/wide")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "p.node-states"), "the node counts")
    text = browser.find_element(By.CSS_SELECTOR, "p.node-states").text
    assert text.startswith(f"{NODES} nodes: {NODES} active") and "showing the 50" in text
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.nodes tbody tr")) == 50
    link = browser.find_element(By.CSS_SELECTOR, "a.all-nodes").get_attribute("href")
    assert link == url + "/ui/api/jobs/team-b/wide/nodes?limit=1000"
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []
