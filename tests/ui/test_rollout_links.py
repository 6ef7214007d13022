"""One click from a rollout to its trace and to its node's log lines, in a real headless chromium against a real
controller with real node daemons and bwrap sandboxes (the test plug-in `scripted-oracle`: no LLM) exporting their
spans over OTLP/HTTP (the real exporters) to a receiver in the test (tests/support/otlp_sink.py), with
ROLLOUTD_TRACE_URL set. A rollout blocked in a tool call: its in-flight row links the trace the receiver holds for
its attempt, and its node's lines naming it. A finished rollout: the trajectory records its attempt and trace ids,
and its page links both. A namespace token of another namespace reads neither the logs nor the in-flight rows."""
from __future__ import annotations

import re
from urllib.parse import urlsplit

import httpx
import pytest
from selenium.webdriver.common.by import By

from support.cluster import Cluster, plugin_env
from support.otlp_sink import OtlpSink
from support.waiting import wait_until

from rolloutd.client import RolloutClient
from rolloutd.controller.access.auth import create_scoped_token

from .test_inflight_view import oracle_job
from .test_ui import console_errors, login, wait

pytestmark = pytest.mark.timeout(600)
TEMPLATE = "https://traces.example/trace/{trace_id}"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout-links")
    receiver = OtlpSink()
    try:
        env = {**plugin_env(), **receiver.env(), "ROLLOUTD_STALLED_AFTER_SECONDS": "1", "ROLLOUTD_TRACE_URL": TEMPLATE}
        c = Cluster(tmp, env).start()
        try:
            with RolloutClient(c.url, token=c.token) as rc:
                rc.apply(oracle_job(tmp, "done", 1, block=False))
                rc.wait("done", timeout=120)
                rc.apply(oracle_job(tmp, "stuck", 1, block=True))
                other = create_scoped_token(c.data_dir / "tokens", "team-x-reader", read_only=True,
                                            namespaces=["team-x"]).token
                yield c, rc, receiver, other
                rc.delete("stuck")
        finally:
            c.stop()
    finally:
        receiver.close()


def ui_get(cluster, token: str, path: str) -> httpx.Response:
    return httpx.get(cluster.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def trace_of(receiver, attempt_id: str) -> str:
    """The receiver's trace id of the attempt's trace (its root span, the controller's, names the attempt)."""
    found: list[str] = []

    def stored() -> bool:
        found[:] = [s["trace"] for s in receiver.stored() if s["name"] == "rollout"
                    and s["attributes"].get("rolloutd.attempt.id") == attempt_id]
        return bool(found)
    wait_until(stored, 60, f"the trace of attempt {attempt_id} at the receiver", every=0.5)
    return found[0]


def test_an_in_flight_rollout_links_its_trace_and_its_log_lines(traced, browser):
    cluster, rc, receiver, _ = traced
    login(browser, cluster.url, cluster.token)
    browser.get(cluster.url + "/ui/jobs/default/stuck")
    read = "return [...document.querySelectorAll('table.inflight-rows tbody tr')].map(r => [r.cells[0].textContent, " \
           "(r.querySelector('a.trace-link') || {}).href, (r.querySelector('a.logs-link') || {}).href])"
    (attempt, trace, logs), = wait(browser, lambda d: (lambda rs: rs if len(rs) == 1 and rs[0][1] else None)(
        d.execute_script(read)), "the stuck rollout's row with its links", timeout=120)
    tid = re.fullmatch(re.escape(TEMPLATE).replace(r"\{trace_id\}", "([0-9a-f]{32})"), trace)
    assert tid, trace
    api = ui_get(cluster, cluster.token, "/ui/api/jobs/default/stuck/inflight").json()["items"][0]
    assert api["attemptId"] == attempt and api["traceId"] == tid.group(1) == urlsplit(logs).query.split("trace=")[1]
    # the root span is exported when it ends (at the result): the receiver is asked for the finished rollout's trace
    # below; this one's id is the one the daemon logged next to the attempt
    browser.get(logs)
    lines = wait(browser, lambda d: (lambda e: e and e[0].text)(d.find_elements(By.ID, "log-lines")), "the log lines")
    assert re.search(rf"rollout {re.escape(attempt)}: job (default/)?stuck.*trace_id={tid.group(1)}", lines), lines
    assert all(attempt in line or tid.group(1) in line for line in lines.splitlines())
    assert browser.find_element(By.CSS_SELECTOR, "a.trace-link").get_attribute("href") == trace
    assert not console_errors(browser)


def test_a_finished_rollout_records_its_ids_and_its_page_links_the_stored_trace(traced, browser):
    cluster, rc, receiver, _ = traced
    (t,) = list(rc.trajectories("done"))
    assert re.fullmatch(r"[0-9a-f]{32}", t["traceId"]) and t["attemptId"]
    assert trace_of(receiver, t["attemptId"]) == t["traceId"]  # the receiver's trace of that attempt
    login(browser, cluster.url, cluster.token)
    browser.get(cluster.url + f"/ui/jobs/default/done/t/{t['seq']}")
    link = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#rollout-links a.trace-link"), "the trace link")[0]
    assert link.get_attribute("href") == TEMPLATE.replace("{trace_id}", t["traceId"])
    assert link.get_attribute("rel") == "noopener noreferrer"
    browser.find_element(By.CSS_SELECTOR, "#rollout-links a.logs-link").click()
    lines = wait(browser, lambda d: (lambda e: e and e[0].text)(d.find_elements(By.ID, "log-lines")), "the log lines")
    assert re.search(rf"rollout {re.escape(t['attemptId'])}: job (default/)?done", lines), lines
    assert not console_errors(browser)


def test_another_namespaces_token_reads_neither_logs_nor_links(traced, browser):
    cluster, rc, _, other = traced
    node = rc.inflight("stuck")["items"][0]["node"]
    for path in (f"/ui/api/jobs/default/stuck/logs?node={node}", "/ui/api/jobs/default/stuck/inflight",
                 "/ui/api/jobs/default/done/logs?node=node0"):
        r = ui_get(cluster, other, path)
        assert r.status_code == 403 and "team-x" in r.text, (path, r.text)
        assert httpx.get(cluster.url + path).status_code == 401
    assert ui_get(cluster, cluster.token, f"/ui/api/jobs/default/stuck/logs?node={node}").status_code == 200
    r = ui_get(cluster, cluster.token, "/ui/api/jobs/default/stuck/logs?node=no-such-node")
    assert r.status_code == 404 and "no node" in r.text
