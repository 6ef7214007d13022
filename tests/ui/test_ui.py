"""The web UI in a real headless chromium against a real controller whose trajectories came through the node
protocol: login, the jobs page live, a job page matching the API, a decoded trajectory, a namespace token's
view (pages and the JSON behind them), a hostile trajectory shown as text under the CSP, no console error.
The screenshots in docs/content/images/ui-*.png are made here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from support.ui_protocol import HOSTILE, P

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "content" / "images"
OURS = ("/ui/static/dom.js", "/ui/static/jobs.js", "/ui/static/jobview.js", "/ui/static/trajectory.js",
        "/ui/static/inflight.js", "/ui/static/app.js")


@pytest.fixture(scope="module")
def jobs(cluster):
    """team-a/alpha: 3 prompts × 2, four reported (one hostile); team-b/secret: 2 × 2, all reported."""
    long = {"leaseSeconds": 600}  # the test holds leases without beating: a busy machine must not expire them
    cluster.create_job("team-a", "alpha", 3, pipeline=long)
    cluster.create_job("team-b", "secret", 2, pipeline=long)
    known = cluster.report("team-a/alpha", 3)
    cluster.report("team-a/alpha", 1, text=HOSTILE, reward=0.0,
                   failure={"kind": "agent", "reason": "bad format: " + HOSTILE})
    cluster.report("team-b/secret", 4)
    alpha, secret = cluster.seqs("team-a", "alpha"), cluster.seqs("team-b", "secret")
    cluster.wait(lambda: cluster.job("team-a", "alpha")["status"]["counts"].get("succeeded") == 4, "alpha's counts")
    return {"known": known[0], "known_seq": alpha[0]["seq"], "hostile_seq": alpha[3]["seq"],
            "secret_seq": secret[0]["seq"]}


def wait(browser, predicate, what: str, timeout: float = 20):
    return WebDriverWait(browser, timeout, poll_frequency=0.05, ignored_exceptions=(StaleElementReferenceException,)
                         ).until(lambda d: predicate(d), message=what)


def cells(browser, table: str) -> list[list[str]]:
    """The text of `table`'s body cells, read in one go (the live pages re-render under the test's feet)."""
    return browser.execute_script(
        "return [...document.querySelectorAll(arguments[0] + ' tbody tr')].map(r => [...r.cells].map(c => c.textContent))",
        table)


def screenshot(browser, name: str) -> None:
    """The whole page (up to 2400 px tall) into docs/content/images/ui-<name>.png."""
    import base64
    IMAGES.mkdir(parents=True, exist_ok=True)
    height = min(2400, browser.execute_script("return document.documentElement.scrollHeight"))
    shot = browser.execute_cdp_cmd("Page.captureScreenshot", {"captureBeyondViewport": True, "clip": {
        "x": 0, "y": 0, "width": 1360, "height": height, "scale": 1}})
    (IMAGES / f"ui-{name}.png").write_bytes(base64.b64decode(shot["data"]))


def console_errors(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


def stage_counts(browser) -> dict[str, int]:
    return browser.execute_script("return Object.fromEntries([...document.querySelectorAll('#job .funnel [data-stage]')]"
                                  ".map(e => [e.dataset.stage, +e.textContent]))")


def login(browser, url: str, token: str) -> None:
    browser.delete_all_cookies()
    browser.get(url + "/ui/jobs")
    wait(browser, lambda d: d.current_url.endswith("/ui/login"), "the jobs page sends a stranger to the login page")
    browser.find_element(By.NAME, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "form#login button").click()
    wait(browser, lambda d: d.current_url.endswith("/ui/jobs") and d.find_elements(By.CSS_SELECTOR, "table.jobs"),
         "the jobs table after login")


def fetch(browser, path: str) -> tuple[int, str]:
    """GET `path` from inside the page, with its cookie: what the page's own script could read."""
    status, body = browser.execute_async_script(
        "const done = arguments[1]; fetch(arguments[0], {credentials: 'same-origin'})"
        ".then(async r => done([r.status, await r.text()])).catch(e => done([0, String(e)]));", path)
    return status, body


@pytest.fixture
def admin(cluster, jobs, browser):
    """The browser logged in with the admin token (each test can run alone)."""
    url = cluster.controller.url
    if not browser.current_url.startswith(url) or fetch(browser, "/ui/api/me")[0] != 200 \
            or json.loads(fetch(browser, "/ui/api/me")[1])["name"] != "admin":
        login(browser, url, cluster.controller.token)
    browser.get_log("browser")  # what came before is not this test's
    return browser


def test_login_sets_an_httponly_strict_session_cookie_and_the_jobs_page_updates_live(cluster, jobs, browser):
    url = cluster.controller.url
    browser.get(url + "/ui/login")
    browser.find_element(By.NAME, "token").send_keys("not-a-token")
    browser.find_element(By.CSS_SELECTOR, "form#login button").click()
    wait(browser, lambda d: d.find_element(By.ID, "failed").is_displayed(), "a wrong token is refused")
    login(browser, url, cluster.controller.token)
    [cookie] = browser.get_cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert cluster.controller.token not in cookie["value"]
    assert browser.execute_script("return document.cookie") == ""  # no script reads the session
    assert {row[1] for row in cells(browser, "table.jobs")} == {"alpha", "secret"}

    def alpha_succeeded(d):  # scored + agent-failed: the columns after queued, init, run, eval
        return next(int(row[8]) + int(row[9]) for row in cells(d, "table.jobs") if row[1] == "alpha")
    wait(browser, lambda d: alpha_succeeded(d) == 4, "alpha's 4 rollouts on the jobs page")
    cluster.report("team-a/alpha", 1)  # the job advances: the page follows without a reload
    wait(browser, lambda d: alpha_succeeded(d) == 5, "the jobs page updates live")
    screenshot(browser, "jobs")
    assert console_errors(browser) == []


def test_job_page_stage_counts_match_the_api(cluster, jobs, admin):
    browser = admin
    browser.get(cluster.controller.url + "/ui/jobs/team-a/alpha")
    api = cluster.job("team-a", "alpha")["status"]["counts"]
    wait(browser, lambda d: stage_counts(d) == {k: api[k] for k in stage_counts(d)} and stage_counts(d),
         f"the funnel shows the API's counts {api}")
    assert set(stage_counts(browser)) == {"queued", "init", "run", "eval", "scored", "agentFailed", "infraFailed",
                                          "cancelled"}
    stages = {row[0]: row[1] for row in cells(browser, "table.stages")}
    assert stages["run"] == "5"  # p50/p95 over the finished rollouts' timings
    failures = " ".join(" ".join(row) for row in cells(browser, "table.failures"))
    assert "agent" in failures and "<script>" in failures  # the hostile reason, as text
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "table.trajectories tbody tr"), "the trajectory list")
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.trajectories tbody tr")) == 5
    examples = browser.execute_script("return [...document.querySelectorAll('table.failures a')].map(a => a.pathname)")
    assert examples == [f"/ui/jobs/team-a/alpha/t/{jobs['hostile_seq']}"]  # the failure's example, one click away
    screenshot(browser, "job")
    browser.find_element(By.NAME, "failure").send_keys("agent")
    browser.find_element(By.CSS_SELECTOR, "form#filter button").click()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "table.trajectories tbody tr")) == 1, "search by failure kind")
    assert [row[0] for row in cells(browser, "table.nodes")] == ["node-alpha"]
    assert console_errors(browser) == []


def test_trajectory_page_shows_the_decoded_turns_and_the_reward(cluster, jobs, admin):
    browser = admin
    seq, known = jobs["known_seq"], jobs["known"]
    browser.get(f"{cluster.controller.url}/ui/jobs/team-a/alpha/t/{seq}")
    wait(browser, lambda d: d.find_elements(By.ID, "reward"), "the trajectory page")
    assert browser.find_element(By.ID, "reward").text == "1"
    assistant = browser.find_element(By.CSS_SELECTOR, "pre.assistant").text
    assert assistant == known["messages"][1]["content"]  # decoded from the token ids with the job's tokenizer
    assert "submitted" in browser.find_element(By.CSS_SELECTOR, "pre.observation").text
    assert known["messages"][0]["content"] in browser.find_element(By.CSS_SELECTOR, "ol.messages").text
    group = browser.find_elements(By.CSS_SELECTOR, "table.group tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in group] == ["1", "0"]
    assert [r.find_elements(By.TAG_NAME, "td")[2].text for r in group] == ["1", "-1"]  # GRPO advantages
    browser.find_element(By.CSS_SELECTOR, "details.tokenview summary").click()
    tokens = browser.find_elements(By.CSS_SELECTOR, ".tokens .tok.m1")
    assert "".join(t.get_attribute("textContent") for t in tokens) == known["messages"][1]["content"]
    assert f"cursor={seq - 1}&limit=1" in browser.find_element(By.ID, "api").text
    screenshot(browser, "trajectory")
    assert console_errors(browser) == []


def test_a_hostile_trajectory_renders_as_text_under_the_csp(cluster, jobs, admin, api):
    browser = admin
    path = f"/ui/jobs/team-a/alpha/t/{jobs['hostile_seq']}"
    browser.get(cluster.controller.url + path)
    wait(browser, lambda d: d.find_elements(By.ID, "reward"), "the hostile trajectory's page")
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    assert HOSTILE in browser.find_element(By.CSS_SELECTOR, "pre.assistant").text
    assert HOSTILE in browser.find_element(By.ID, "failure-reason").text
    scripts = [s.get_attribute("src") for s in browser.find_elements(By.TAG_NAME, "script")]
    assert [s.removeprefix(cluster.controller.url) for s in scripts] == list(OURS)
    assert not browser.find_elements(By.CSS_SELECTOR, "main img, main a[href^='javascript']")
    assert console_errors(browser) == []  # nothing ran, nothing was blocked either: it never became markup
    # and were some text to become markup, the CSP would still refuse to run it
    browser.execute_script("const s = document.createElement('script'); s.textContent = 'window.pwned = 1';"
                           "document.body.append(s); const i = document.createElement('img'); i.src = 'x';"
                           "i.setAttribute('onerror', 'window.pwned = 2'); document.body.append(i);")
    wait(browser, lambda d: any("Content Security Policy" in e["message"] for e in d.get_log("browser")),
         "chromium reports the CSP refusing the inline script")
    assert browser.execute_script("return window.pwned") is None
    csp = api.get(path).headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert api.get("/ui/static/app.js").headers["x-content-type-options"] == "nosniff"


def test_a_namespace_token_sees_only_its_namespace(cluster, jobs, browser):
    url = cluster.controller.url
    login(browser, url, cluster.scoped)
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "table.jobs tbody tr")) == 1, "one job listed")
    assert "alpha" in browser.find_element(By.CSS_SELECTOR, "table.jobs").text
    assert "secret" not in browser.page_source
    status, body = fetch(browser, "/ui/api/jobs")
    assert status == 200 and [j["name"] for j in json.loads(body)["items"]] == ["alpha"]
    for path in ("/ui/api/jobs/team-b/secret", f"/ui/api/jobs/team-b/secret/trajectories/{jobs['secret_seq']}",
                 "/ui/api/jobs/team-b/secret/trajectories"):
        status, body = fetch(browser, path)
        assert status == 403 and "team-b" in body, (path, body)
    status, _ = fetch(browser, f"/ui/api/jobs/team-a/alpha/trajectories/{jobs['secret_seq']}")
    assert status == 404  # another job's seq, asked through a job the token may read
    status, _ = fetch(browser, "/apis/rolloutd.io/v1alpha1/rolloutjobs")
    assert status == 401  # the session cookie is no API credential
    browser.get(f"{url}/ui/jobs/team-b/secret/t/{jobs['secret_seq']}")
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "main .error"), "the page says no")
    assert "limited to team-a" in browser.find_element(By.CSS_SELECTOR, "main .error").text
    console_errors(browser)  # the 403 is the resource's own answer (logged by chromium as a failed load)
    browser.get(f"{url}/ui/jobs/team-a/alpha/t/{jobs['known_seq']}")
    wait(browser, lambda d: d.find_elements(By.ID, "reward"), "its own namespace's trajectory")
    assert console_errors(browser) == []


def test_state_changes_need_post_csrf_and_this_origin(cluster, jobs, api):
    r = api.post("/ui/login", data={"token": cluster.controller.token}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs"
    sid = r.cookies["rolloutd_session"]
    import httpx
    with httpx.Client(base_url=cluster.controller.url, cookies={"rolloutd_session": sid}) as session:
        assert session.get("/ui/api/jobs").status_code == 200
        assert session.get("/ui/logout").status_code == 405  # no state-changing GET
        assert session.post("/ui/logout").status_code == 403  # no csrf field
        csrf = session.get("/ui/api/me").json()["csrf"]
        assert session.post("/ui/logout", data={"csrf": csrf}, headers={"Origin": "https://evil.example"}).status_code == 403
        assert session.post("/ui/logout", data={"csrf": "x" + csrf}).status_code == 403
        assert session.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
        assert session.get("/ui/api/jobs").status_code == 401  # logged out: the session is gone on the server
    assert api.post("/ui/login", data={"token": cluster.controller.token},
                    headers={"Origin": "https://evil.example"}).status_code == 403
    assert api.post("/ui/login", data={"token": "x" * 100_000}).status_code == 413
    # a session ends with its token: deleting a scoped token's file logs its browsers out
    from rolloutd.controller.access.auth import create_scoped_token
    gone = create_scoped_token(cluster.controller.data_dir / "tokens", "short-lived", read_only=True, namespaces=["team-a"])
    r = api.post("/ui/login", data={"token": gone.token}, follow_redirects=False)
    with httpx.Client(base_url=cluster.controller.url, cookies={"rolloutd_session": r.cookies["rolloutd_session"]}) as s:
        assert s.get("/ui/api/jobs").status_code == 200
        (cluster.controller.data_dir / "tokens" / "short-lived.json").unlink()
        assert s.get("/ui/api/jobs").status_code == 401
    credential = cluster.admin.post(f"{P}/namespaces/team-a/rolloutjobs/alpha/nodes/credential").json()["credential"]
    assert api.get("/ui/api/jobs", headers={"Authorization": f"Bearer {credential}"}).status_code == 401  # a node's
    r = api.get("/ui/api/jobs", headers={"Authorization": f"Bearer {cluster.scoped}"})
    assert [j["name"] for j in r.json()["items"]] == ["alpha"]


def test_rolloutctl_trajectory_prints_the_decoded_conversation(cluster, jobs):
    import subprocess
    import sys

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", "--server", cluster.controller.url,
                               "--token-file", str(cluster.controller.data_dir / "token"), "-n", "team-a", *args],
                              capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    known = jobs["known"]
    r = ctl("trajectory", "alpha", str(jobs["known_seq"]))
    assert r.returncode == 0, r.stderr
    assert known["messages"][0]["content"] in r.stdout and known["messages"][1]["content"] in r.stdout
    assert "reward" in r.stdout and "1.0" in r.stdout and "tokens: " in r.stdout
    r = ctl("trajectory", "alpha", str(jobs["hostile_seq"]))
    assert r.returncode == 0, r.stderr
    assert '<script>alert("xss")</script>' in r.stdout and "[me](javascript:alert(4))" in r.stdout  # as text, no markup
    r = ctl("trajectory", "alpha", str(jobs["secret_seq"]))  # another job's seq
    assert r.returncode == 1 and "no trajectory" in r.stderr


def test_job_page_draws_throughput_over_time_and_each_nodes_in_flight_count(cluster, jobs, admin):
    """The chart's bars add up to the finished rollouts and the node's in-flight count is the leases this test
    holds; both follow the job live when one more rollout is reported."""
    browser = admin
    key = "team-a/alpha"
    browser.get(cluster.controller.url + "/ui/jobs/team-a/alpha")

    def shown(d) -> tuple[int, int, int]:
        return tuple(d.execute_script(
            "const svg = document.querySelector('#throughput'), n = document.querySelector('table.nodes .inflight');"
            "return [svg ? [...svg.querySelectorAll('rect')].reduce((s, r) => s + +r.dataset.n, 0) : -1,"
            "        svg ? +svg.dataset.total : -1, n ? +n.textContent : -1]"))

    def expected() -> tuple[int, int, int]:
        finished = len(cluster.seqs("team-a", "alpha"))
        return finished, finished, len(cluster.leases[key])

    held = len(cluster.leases[key])
    assert held >= 1  # the fixture leased all six and reported fewer
    wait(browser, lambda d: shown(d) == expected(), f"a chart of {expected()[0]} rollouts, {held} in flight")
    api = json.loads(fetch(browser, "/ui/api/jobs/team-a/alpha")[1])
    assert sum(api["throughput"]["counts"]) == expected()[0] and len(api["throughput"]["counts"]) <= 60
    assert [n["inflight"] for n in api["nodes"]] == [held]
    before = shown(browser)
    cluster.report(key, 1)
    wait(browser, lambda d: shown(d) == (before[0] + 1, before[1] + 1, held - 1), "the chart and the node follow live")
    assert console_errors(browser) == []
