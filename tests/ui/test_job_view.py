"""The job page's deeper views in a real headless chromium against a real controller whose trajectories came through
the node protocol: the config panel (secrets redacted), reward and pass-rate curves per policy version, response
length, turn, tool-error and truncation curves per policy version and over time (against the trajectories' own
counts), pass rates per prompt, zero-variance groups counted and listed, a sortable trajectories table whose filters and sort live in
the URL (a reload shows the same view), the token view's legend painted by the tokens' own colour function, and
every new JSON route refused to a namespace token of another namespace."""
from __future__ import annotations

import json

import pytest
from selenium.webdriver.common.by import By

from support.ui_protocol import P, TINY

from rolloutd.crds.node import NODE_PROTOCOL

from .test_ui import IMAGES, console_errors, fetch, login, wait

SECRET = "sk-live0123456789abcdef"
# (prompt, sample) → (reward, policy version): prompt 0 all 1 and prompt 1 all 0 (zero variance), prompt 2 mixed,
# prompt 3 half reported (an incomplete group is no zero-variance group yet)
PLAN = {(0, 0): (1.0, 0), (0, 1): (1.0, 0), (1, 0): (0.0, 1), (1, 1): (0.0, 1), (2, 0): (1.0, 1), (2, 1): (0.0, 1),
        (3, 0): (1.0, 2)}


def make_job(cluster, namespace: str, name: str, prompts: int, **spec) -> str:
    data = cluster.base / f"{namespace}-{name}.jsonl"
    data.write_text("".join(json.dumps({"id": f"{name}-q{i}", "question": f"What is {i}+3?", "answer": str(i + 3)}) + "\n"
                            for i in range(prompts)))
    doc = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name, "namespace": namespace},
           "spec": {"tasks": {"kind": "math", "source": str(data)}, "samplesPerPrompt": 2,
                    "llm": {"tokenizer": str(TINY)},
                    "agent": {"systemPrompt": f"Reason step by step. OPENAI_API_KEY={SECRET}; later {SECRET}."},
                    "sandbox": {"env": {"MY_API_TOKEN": SECRET, "LANG": "C.UTF-8"}},
                    "pipeline": {"leaseSeconds": 600}, "executor": {"kind": "local", "nodes": 0}, **spec}}
    r = cluster.admin.post(f"{P}/namespaces/{namespace}/rolloutjobs", json=doc)
    assert r.status_code == 201, r.text
    key = f"{namespace}/{name}"
    cluster.wait(lambda: cluster.job(namespace, name)["status"].get("counts", {}).get("total") == 2 * prompts, "expanded")
    r = cluster.node_api.post(f"{P}/namespaces/{namespace}/rolloutjobs/{name}/nodes/register",
                              json={"job": key, "name": f"node-{name}", "host": "test-host", "protocol": NODE_PROTOCOL})
    assert r.status_code == 200, r.text
    cluster.nodes[key], cluster.leases[key] = r.json()["nodeId"], []
    assert cluster.lease(key, 2 * prompts) == 2 * prompts
    return key


def shape(t: dict, prompt: int, sample: int) -> None:
    """Vary what the length curves count: sample 1 answers in two turns; prompt 2's agent reports no metrics (its
    turns' own slices count); prompt 1's made a tool error; (1, 1) was cut at the token limit."""
    turn = t["turns"][0]
    if sample == 1:
        mid = (turn["generatedStart"] + turn["generatedEnd"]) // 2
        t["turns"] = [{"generatedStart": turn["generatedStart"], "generatedEnd": mid, "finishReason": "stop"},
                      {**turn, "generatedStart": mid}]
    if prompt != 2:
        t["metrics"] = {"turns": len(t["turns"]), "generated_tokens": generated(t), "tool_errors": int(prompt == 1)}
    if (prompt, sample) == (1, 1):
        t["finishReason"] = "length"


def generated(t: dict) -> int:
    return sum(turn["generatedEnd"] - turn["generatedStart"] for turn in t["turns"])


def expected_lengths(sent: list[dict]) -> list[tuple]:
    """Per policy version (in the order they first came): mean generated tokens, mean turns, tool-error rate (of the
    rollouts whose agent counts them), truncation rate — from the trajectories as they were sent."""
    out = []
    for v in dict.fromkeys(t["policyVersion"] for t in sent):
        ts = [t for t in sent if t["policyVersion"] == v]
        counted = [t["metrics"]["tool_errors"] > 0 for t in ts if "metrics" in t]
        out.append((v, round(sum(map(generated, ts)) / len(ts), 4), round(sum(len(t["turns"]) for t in ts) / len(ts), 4),
                    round(sum(counted) / len(counted), 4) if counted else None,
                    round(sum(t["finishReason"] == "length" for t in ts) / len(ts), 4)))
    return out


@pytest.fixture(scope="module")
def view(cluster):
    key = make_job(cluster, "team-a", "curves", 4)
    sent = []
    for lease in cluster.leases[key]:
        plan = PLAN.get((lease["prompt"], lease["sample"]))
        if plan is None:
            continue
        t = cluster.trajectory(key, lease, str(lease["task"]["answer"]), plan[0])
        t["policyVersion"] = plan[1]
        shape(t, lease["prompt"], lease["sample"])
        r = cluster.node_api.post(f"{P}/nodes/{cluster.nodes[key]}/results",
                                  json={"results": [{"attemptId": lease["attemptId"], "trajectory": t}]})
        assert r.status_code == 200 and lease["attemptId"] in r.json()["accepted"], r.text
        sent.append(t)
    other = make_job(cluster, "team-b", "hidden", 1)
    cluster.report(other, 2)
    return {"sent": sent}


@pytest.fixture
def admin(cluster, browser):
    """The browser logged in with the admin token."""
    url = cluster.controller.url
    if not browser.current_url.startswith(url) or fetch(browser, "/ui/api/me")[0] != 200 \
            or json.loads(fetch(browser, "/ui/api/me")[1])["name"] != "admin":
        login(browser, url, cluster.controller.token)
    browser.get_log("browser")  # what came before is not this test's
    return browser


def test_curves_pass_rates_and_zero_variance_groups_count_the_reported_rewards(cluster, view):
    r = cluster.admin.get("/ui/api/jobs/team-a/curves/curves")
    assert r.status_code == 200, r.text
    c = r.json()
    assert [(p["policyVersion"], p["n"], p["rewardMean"], p["passRate"]) for p in c["byPolicy"]] == \
        [(0, 2, 1.0, 1.0), (1, 4, 0.25, 0.25), (2, 1, 1.0, 1.0)]
    assert sum(p["n"] for p in c["overTime"]["points"]) == 7
    rates = {p["prompt"]: (p["n"], p["passed"]) for p in c["prompts"]["items"]}
    assert rates == {0: (2, 2), 1: (2, 0), 2: (2, 1), 3: (1, 1)} and c["prompts"]["passed"] == 3
    lengths = [(p["policyVersion"], p["generatedMean"], p["turnsMean"], p["toolErrorRate"], p["truncationRate"])
               for p in c["byPolicy"]]
    assert lengths == expected_lengths(view["sent"])
    assert [(v, turns, errors, cut) for v, _, turns, errors, cut in lengths] == \
        [(0, 1.5, 0.0, 0.0), (1, 1.5, 1.0, 0.25), (2, 1.0, 0.0, 0.0)]  # (prompt 2's agent counts no tool errors)
    points = c["overTime"]["points"]  # every rollout in one bucket or another: the sums are the trajectories'
    assert sum(p["n"] * p["generatedMean"] for p in points) == pytest.approx(sum(map(generated, view["sent"])), abs=0.01)
    assert sum(p["n"] * p["turnsMean"] for p in points) == pytest.approx(sum(len(t["turns"]) for t in view["sent"]),
                                                                        abs=0.01)
    assert sum(p["n"] * p["truncationRate"] for p in points) == pytest.approx(1, abs=0.01)
    zv = c["zeroVariance"]
    assert zv["count"] == 2 and zv["completeGroups"] == 3
    assert sorted((g["prompt"], g["reward"], g["n"]) for g in zv["items"]) == [(0, 1.0, 2), (1, 0.0, 2)]


def test_config_panel_shows_the_spec_without_its_secrets(cluster, view, admin):
    r = cluster.admin.get("/ui/api/jobs/team-a/curves/config")
    assert r.status_code == 200 and SECRET not in r.text, r.text
    spec = r.json()["spec"]
    assert spec["sandbox"]["env"] == {"MY_API_TOKEN": "(redacted)", "LANG": "C.UTF-8"}
    assert spec["llm"]["tokenizer"] == str(TINY)  # a tokenizer is no token
    assert spec["agent"]["systemPrompt"] == "Reason step by step. OPENAI_API_KEY=(redacted) later (redacted)."
    admin.get(cluster.controller.url + "/ui/jobs/team-a/curves")
    text = wait(admin, lambda d: d.execute_script("const e = document.getElementById('config-spec'); "
                                                  "return e && e.textContent"), "the config panel")
    assert SECRET not in admin.page_source and "(redacted)" in text and str(TINY) in admin.page_source
    assert "C.UTF-8" in text


def test_redact_keeps_the_spec_and_hides_what_may_be_a_secret():
    from rolloutd.controller.ui.jobview import redact
    spec = {"llm": {"tokenizer": "/m/tok", "backends": [{"url": "https://u:pw@vllm:8000/"}]},
            "agent": {"sampling": {"maxTokens": 64}, "systemPrompt": "hf_abcdefghijkl and ghp_abcdefghijkl"},
            "sandbox": {"env": {"PASSWORD": "x", "HF_TOKEN": "y", "PATH": "/bin"}}, "apiKey": "k"}
    assert redact(spec) == {"llm": {"tokenizer": "/m/tok", "backends": [{"url": "https://(redacted)@vllm:8000/"}]},
                            "agent": {"sampling": {"maxTokens": 64}, "systemPrompt": "(redacted) and (redacted)"},
                            "sandbox": {"env": {"PASSWORD": "(redacted)", "HF_TOKEN": "(redacted)", "PATH": "/bin"}},
                            "apiKey": "(redacted)"}


def test_job_page_draws_the_curves_and_counts_the_zero_variance_groups(cluster, view, admin):
    admin.get(cluster.controller.url + "/ui/jobs/team-a/curves")
    wait(admin, lambda d: d.find_elements(By.ID, "zero-variance-count"), "the curves panel")
    assert admin.find_element(By.ID, "zero-variance-count").text == "2"
    dots = admin.execute_script("return [...document.querySelectorAll('#curve-policy circle.reward')]"
                                ".map(c => [c.dataset.x, +c.dataset.y])")
    assert dots == [["0", 1.0], ["1", 0.25], ["2", 1.0]]
    passes = admin.execute_script("return [...document.querySelectorAll('#curve-policy circle.pass')].map(c => +c.dataset.y)")
    assert passes == [1.0, 0.25, 1.0]
    assert len(admin.find_elements(By.CSS_SELECTOR, "table.zero-variance tbody tr")) == 2
    points = "return [...document.querySelectorAll(arguments[0])].map(c => [c.dataset.x, +c.dataset.y])"
    want = expected_lengths(view["sent"])
    for selector, column in (("#curve-policy-length circle.generated", 1), ("#curve-policy-turns circle.turns", 2),
                             ("#curve-policy-rates circle.tool-errors", 3), ("#curve-policy-rates circle.truncated", 4)):
        assert admin.execute_script(points, selector) == [[str(w[0]), w[column]] for w in want if w[column] is not None]
    api = cluster.admin.get("/ui/api/jobs/team-a/curves/curves").json()["overTime"]["points"]
    drawn = admin.execute_script("return [...document.querySelectorAll('#curve-time-length circle.generated')]"
                                 ".map(c => +c.dataset.y)")
    assert drawn == [p["generatedMean"] for p in api]  # over time: one dot per bucket that holds a rollout
    assert admin.execute_script(points, "#curve-time-rates circle.truncated")  # drawn, zeros too
    assert console_errors(admin) == []
    IMAGES.mkdir(parents=True, exist_ok=True)  # the docs' picture of the panel (docs/content/ui.md)
    size = admin.get_window_size()
    admin.set_window_size(size["width"], 2400)  # the whole panel (the length curves below the reward's)
    try:
        (IMAGES / "ui-job-curves.png").write_bytes(admin.find_element(By.ID, "curves").screenshot_as_png)
    finally:
        admin.set_window_size(size["width"], size["height"])


def test_trajectory_filters_and_sort_live_in_the_url(cluster, view, admin):
    url = cluster.controller.url + "/ui/jobs/team-a/curves"
    admin.get(url)
    rows = "return [...document.querySelectorAll('table.trajectories tbody tr')].map(r => +r.cells[4].textContent)"
    wait(admin, lambda d: len(d.execute_script(rows)) == 7, "seven trajectories")
    for _ in range(2):  # ascending, then descending
        before = admin.execute_script("return document.getElementById('results').dataset.query")
        admin.find_element(By.CSS_SELECTOR, "a.sort[data-sort=reward]").click()
        wait(admin, lambda d: d.execute_script("return document.getElementById('results').dataset.query") != before,
             "the table sorted again")
    admin.find_element(By.NAME, "rewardMax").send_keys("0.5")
    admin.find_element(By.CSS_SELECTOR, "form#filter button").click()
    wait(admin, lambda d: "rewardMax=0.5" in d.current_url, "the filter in the URL")
    assert "sort=-reward" in admin.current_url
    shared = admin.current_url
    admin.get(shared)  # a shared link shows the same view
    wait(admin, lambda d: len(d.execute_script(rows)) == 3, "the three zero rewards")
    assert admin.find_element(By.NAME, "rewardMax").get_attribute("value") == "0.5"
    assert "▼" in admin.find_element(By.CSS_SELECTOR, "a.sort[data-sort=reward]").text
    admin.get(url + "?sort=-reward")
    wait(admin, lambda d: len(d.execute_script(rows)) == 7, "all seven")
    assert admin.execute_script(rows) == sorted(admin.execute_script(rows), reverse=True)
    api = cluster.admin.get("/ui/api/jobs/team-a/curves/trajectories?sort=-duration&limit=3").json()["items"]
    assert [t["seconds"] for t in api] == sorted((t["seconds"] for t in api), reverse=True)
    sent = {(t["prompt"], t["sample"]): t for t in view["sent"]}
    assert all(t["tokens"] > t["generatedTokens"] > 0 for t in api)
    assert [(t["generatedTokens"], t["turns"]) for t in api] == \
        [(generated(sent[t["prompt"], t["sample"]]), len(sent[t["prompt"], t["sample"]]["turns"])) for t in api]
    assert cluster.admin.get("/ui/api/jobs/team-a/curves/trajectories?sort=data").status_code == 422
    assert console_errors(admin) == []


def test_the_token_legend_uses_the_tokens_colours(cluster, view, admin):
    seq = next(t["seq"] for t in cluster.seqs("team-a", "curves"))
    admin.get(cluster.controller.url + f"/ui/jobs/team-a/curves/t/{seq}")
    wait(admin, lambda d: d.find_elements(By.ID, "token-legend"), "the token view")
    legend = admin.find_element(By.ID, "token-legend").get_attribute("textContent")
    assert "darker green" not in legend and "low logprob" in legend
    key = admin.execute_script("return Object.fromEntries([...document.querySelectorAll('.lp-key')].map(e => "
                               "[e.dataset.logprob, getComputedStyle(e).backgroundColor]))")
    rgb = {lp: tuple(int(x) for x in c[c.index("(") + 1:-1].split(",")[:3]) for lp, c in key.items()}
    likely, unlikely = rgb["0"], min(rgb.items(), key=lambda kv: float(kv[0]))[1]
    assert likely[1] > likely[0] and unlikely[0] > unlikely[1]  # green when likely, red when not
    # a token sampled with logprob 0 wears the legend's "p = 1" colour
    token = admin.execute_script("const t = [...document.querySelectorAll('.tokens .tok.m1')].find(e => "
                                 "/logprob (-)?0$/.test(e.title)); return t && getComputedStyle(t).backgroundColor")
    assert token == key["0"]


def test_a_namespace_token_cannot_read_another_namespaces_config_curves_or_rows(cluster, view, browser):
    login(browser, cluster.controller.url, cluster.scoped)
    for path in ("/ui/api/jobs/team-b/hidden/config", "/ui/api/jobs/team-b/hidden/curves",
                 "/ui/api/jobs/team-b/hidden/trajectories?sort=-reward"):
        status, body = fetch(browser, path)
        assert status == 403 and "team-b" in body, (path, body)
    status, body = fetch(browser, "/ui/api/jobs/team-a/curves/config")
    assert status == 200 and SECRET not in body
    with cluster.admin.__class__(base_url=cluster.controller.url) as anonymous:
        assert anonymous.get("/ui/api/jobs/team-a/curves/config").status_code == 401
        assert anonymous.get("/ui/api/jobs/team-a/curves/curves").status_code == 401
