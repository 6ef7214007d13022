"""The job page's "In flight" panel and the trajectory page's waterfall in a real headless chromium, against a real
controller with a real node daemon and bwrap sandboxes (the test plug-in `scripted-oracle`, `agent.kind: oracle`:
no LLM, no engine). One job's rollouts sit in RUN inside a bash tool call that sleeps: the panel shows them stalled
in run with their time in stage (the controller's threshold set to 1 s). Another job runs to the end: its
trajectory's waterfall has one bar per stage as long as the trajectory's `timings` say, and the job page's time
split across stages sums the same."""
from __future__ import annotations

import json

import pytest
from selenium.webdriver.common.by import By

from support.cluster import Cluster, plugin_env
from support.waiting import wait_until

from rolloutd.client import RolloutClient

from .test_ui import console_errors, login, wait

pytestmark = pytest.mark.timeout(300)


def oracle_job(tmp, name: str, rows: int, block: bool) -> dict:
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": f"{i}+{i}?", "answer": str(2 * i), "blockInTool": block})
                            + "\n" for i in range(rows)))
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
            "spec": {"tasks": {"kind": "scripted-oracle", "source": str(data)}, "samplesPerPrompt": 1,
                     "agent": {"kind": "oracle"}, "sandbox": {"runtime": "bwrap", "warm": 0},
                     "executor": {"kind": "local", "nodes": 1},
                     "pipeline": {"workersPerNode": {"init": 2, "run": 2, "eval": 2}, "maxAttempts": 1}}}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inflight-ui")
    c = Cluster(tmp, {**plugin_env(), "ROLLOUTD_STALLED_AFTER_SECONDS": "1"}).start()
    try:
        with RolloutClient(c.url, token=c.token) as rc:
            rc.apply(oracle_job(tmp, "done", 1, block=False))
            rc.wait("done", timeout=120)
            rc.apply(oracle_job(tmp, "stuck", 2, block=True))
            yield c, rc
            rc.delete("stuck")
    finally:
        c.stop()


def test_rollouts_blocked_in_a_tool_call_show_as_stalled_in_run_with_their_time(live, browser):
    cluster, rc = live
    login(browser, cluster.url, cluster.token)
    browser.get(cluster.url + "/ui/jobs/default/stuck")
    read = "return [...document.querySelectorAll('table.inflight-rows tbody tr')].map(r => " \
           "[r.querySelector('.stage').textContent, +r.querySelector('.in-stage').dataset.seconds, " \
           "!!r.querySelector('.stalled')])"
    rows = wait(browser, lambda d: (lambda rs: rs if len(rs) == 2 and all(s == "run" and st for s, _, st in rs)
                                    else None)(d.execute_script(read)), "both rollouts stalled in run", timeout=120)
    assert all(seconds >= 1 for _, seconds, _ in rows)
    api = rc.inflight("stuck")  # the panel shows what the API says
    assert api["stalled"] == 2 and {r["stage"] for r in api["items"]} == {"run"}
    assert "2 stalled" in browser.find_element(By.ID, "stalled-count").text
    assert not console_errors(browser)


def test_the_waterfall_and_the_jobs_time_split_equal_the_trajectorys_timings(live, browser):
    cluster, rc = live
    (t,) = list(rc.trajectories("done"))
    timings = t["timings"]
    login(browser, cluster.url, cluster.token)
    browser.get(cluster.url + f"/ui/jobs/default/done/t/{t['seq']}")
    bars = wait(browser, lambda d: d.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#waterfall .wfrow[data-kind=stage]')]"
        ".map(r => [r.dataset.label, +r.dataset.seconds]))") or None, "the waterfall's stage bars")
    assert bars == {stage: round(timings[stage], 6) for stage in ("init", "run", "eval")}
    browser.get(cluster.url + "/ui/jobs/default/done")
    split = wait(browser, lambda d: d.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('[data-stage-seconds]')]"
        ".map(e => [e.dataset.stageSeconds, +e.textContent]))") or None, "the job's time split")
    assert split == {stage: round(timings[stage], 3) for stage in ("queue", "init", "run", "eval")}
    assert not console_errors(browser)
