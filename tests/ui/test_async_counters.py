"""The job page's policy-version and staleness counters in a real headless chromium, against a real controller whose
rollouts are leased through the node protocol: a job bounded at `maxStaleness: 0` whose four rollouts are in flight
when the trainer announces version 1 has them cancelled and queued again by the sweep (`work/staleness.py`); the
page shows the same counters as the trainer API's `…/policy` and /metrics, and the curves say how many versions
behind the current one each delivered version is."""
from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from support.ui_protocol import P

from .test_job_view import admin, make_job  # noqa: F401 - fixtures
from .test_ui import console_errors, wait

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def swept(cluster):
    key = make_job(cluster, "team-a", "async", 2, policy={"maxStaleness": 0})
    cluster.report(key, 1)  # one delivered at no version yet
    r = cluster.admin.post(f"{P}/namespaces/team-a/rolloutjobs/async/policy", json={"version": 1, "pause": False})
    assert r.status_code == 200, r.text
    return {"announce": r.json()}


def test_the_job_page_shows_the_staleness_counters_the_api_and_metrics_report(cluster, swept, admin):
    policy = cluster.admin.get(f"{P}/namespaces/team-a/rolloutjobs/async/policy").json()
    st = policy["staleness"]
    assert st["cancelledRollouts"] == 3 == swept["announce"]["staleness"]["cancelledRollouts"]  # the three in flight
    admin.get(cluster.controller.url + "/ui/jobs/team-a/async")
    read = "return Object.fromEntries([...document.querySelectorAll('[data-counter]')].map(e => [e.dataset.counter, +e.textContent]))"
    shown = wait(admin, lambda d: d.execute_script(read) or None, "the staleness counters")
    assert shown == {"gated": st.get("gated", 0), "cancelledRollouts": 3, "sweptGroups": st.get("sweptGroups", 0),
                     "rerun": st.get("rerun", 0)}
    summary = admin.find_element(By.ID, "policy-summary").text
    assert "version 1" in summary and "1 announced" in summary and "max staleness 0" in summary
    metrics = cluster.admin.get("/metrics").text
    assert "rolloutd_stale_rollouts_cancelled_total 3.0" in metrics  # the only job of this controller that swept
    curves = cluster.admin.get("/ui/api/jobs/team-a/async/curves").json()["byPolicy"]
    assert [(p["policyVersion"], p["behind"], p["n"]) for p in curves] == [(0, None, 1)]
    assert console_errors(admin) == []
