"""Bad input never gets a 500 and is never stored: a real controller process (uvicorn) per test module,
plus the real `rolloutctl` for the CLI's side. Each case here answered 500 (or 200/201) before."""
from __future__ import annotations

import json
import sqlite3

import pytest
import yaml

from support.controller_process import ControllerProcess, ctl
from .http.test_api import P, YAML, _fields, _status, doc

JSON = {"Content-Type": "application/json"}
HUGE = "99999999999999999999999"


def test_non_finite_floats_are_refused_naming_the_field_and_nothing_is_stored(bad_api, example_yaml):
    text = json.dumps(doc(example_yaml, "inf-json")).replace('"temperature": 1.0', '"temperature": Infinity')
    body = _status(bad_api.post(P, content=text, headers=JSON), 422)
    assert _fields(body) == ["spec.agent.sampling.temperature"]
    as_yaml = example_yaml.replace("name: math-demo", "name: inf-yaml").replace("temperature: 1.0", "temperature: .inf")
    body = _status(bad_api.post(P, content=as_yaml, headers=YAML), 422)
    assert _fields(body) == ["spec.agent.sampling.temperature"]
    nan = doc(example_yaml, "nan-yaml")
    nan["spec"]["pipeline"]["leaseSeconds"] = float("nan")  # any float field of the spec
    body = _status(bad_api.put(f"{P}/nan-yaml", content=yaml.safe_dump(nan), headers=YAML), 422)
    assert _fields(body) == ["spec.pipeline.leaseSeconds"]
    assert bad_api.get(P).status_code == 200
    for name in ("inf-json", "inf-yaml", "nan-yaml"):
        _status(bad_api.get(f"{P}/{name}"), 404)


def test_list_skips_a_row_it_cannot_serve_across_restarts(controller, api, example_yaml):
    assert api.post(P, json=doc(example_yaml, "good")).status_code == 201
    spec = json.dumps(doc(example_yaml)["spec"]).replace('"temperature": 1.0', '"temperature": Infinity')
    with sqlite3.connect(controller.data_dir / "rolloutd.db") as db:  # rows an older, laxer version wrote
        for name, row_spec in (("bad-inf", spec), ("bad-json", "{not json")):
            db.execute("INSERT INTO jobs (name, uid, generation, resource_version, labels, annotations, spec, status,"
                       " created) VALUES (?, 'u', 1, 1, '{}', '{}', ?, '{}', '2026-01-01 00:00:00')", (name, row_spec))
    for _ in range(2):
        listing = api.get(P)
        assert listing.status_code == 200, listing.text
        assert [i["metadata"]["name"] for i in listing.json()["items"]] == ["good"]
        table = ctl(controller, "get", "rj")
        assert table.returncode == 0 and "good" in table.stdout and "Traceback" not in table.stderr
        assert "delete it" in api.get(f"{P}/bad-inf").json()["message"]
        controller.restart()
    rv = api.get(P).json()["metadata"]["resourceVersion"]
    assert api.delete(f"{P}/bad-inf").status_code == 202  # deletable, and gone at once
    _status(api.get(f"{P}/bad-inf"), 404)
    watched = api.get(P, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": 1})
    assert watched.status_code == 200 and "Infinity" not in watched.text  # the stream skips what JSON cannot carry
    log = (controller.data_dir.parent / f"controller-{controller.port}.log").read_text()
    assert "list skips a row" in log and "bad-json" in log and "watch skips change" in log


def test_deep_nesting_is_400_not_a_recursion_error(bad_api):
    for text, headers in (('{"a":' * 100_000, JSON), ("[" * 100_000, YAML), ("a:\n" + "  - " * 200 + "x\n", YAML),
                          ('{"metadata":' * 70 + "1" + "}" * 70, JSON)):
        body = _status(bad_api.post(P, content=text, headers=headers), 400)
        assert "nest" in body["message"]


def test_yaml_alias_bombs_are_refused(bad_api):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(6))
    assert "YAML aliases" in _status(bad_api.post(P, content=bomb, headers=YAML), 400)["message"]


def test_integers_beyond_int64_are_4xx_in_path_query_and_body(bad_api, example_yaml):
    assert bad_api.post(P, json=doc(example_yaml, "ints")).status_code in (201, 409)
    _status(bad_api.get(f"{P}/ints/trajectories", params={"cursor": HUGE}), 400)
    _status(bad_api.get(f"{P}/ints/batches/{HUGE}"), 400)
    _status(bad_api.get(f"{P}/ints/batches/-{HUGE}"), 400)
    _status(bad_api.get(P, params={"watch": "true", "resourceVersion": HUGE}), 400)
    _status(bad_api.get(P, params={"watch": "true"}, headers={"Last-Event-ID": "²".encode()}), 400)
    body = _status(bad_api.post(f"{P}/ints/batches", content='{"batch": %s}' % HUGE, headers=JSON), 422)
    assert _fields(body) == ["batch"]
    d = doc(example_yaml, "ints")
    d["spec"]["tasks"]["limit"] = int(HUGE)
    assert _fields(_status(bad_api.put(f"{P}/ints", json=d), 422)) == ["spec.tasks.limit"]
    body = _status(bad_api.post("/apis/rolloutd.io/v1alpha1/nodes/n1/lease", json={"maxItems": int(HUGE)}), 422)
    assert _fields(body) == ["maxItems"]
    digits = "1" * 5000  # more than Python converts to an int (4300): a 500 in both parsers before
    text = json.dumps(doc(example_yaml, "digits")).replace('"temperature": 1.0', f'"temperature": {digits}')
    assert "cannot be read" in _status(bad_api.post(P, content=text, headers=JSON), 400)["message"]
    as_yaml = example_yaml.replace("name: math-demo", "name: digits").replace("temperature: 1.0", f"temperature: {digits}")
    assert "cannot be read" in _status(bad_api.post(P, content=as_yaml, headers=YAML), 400)["message"]
    assert "out of range for month" in _status(bad_api.post(P, content=as_yaml.replace(f"temperature: {digits}",
                                                                                      "temperature: 2026-02-30"),
                                                            headers=YAML), 400)["message"]
    _status(bad_api.get(f"{P}/digits"), 404)


def test_text_plain_is_415(bad_api, example_yaml):
    _status(bad_api.post(P, content=example_yaml, headers={"Content-Type": "text/plain"}), 415)
    _status(bad_api.get(P + "/math-demo"), 404)


def test_status_with_a_malformed_resource_version_is_400_and_a_stale_one_409(bad_api, example_yaml):
    created = bad_api.put(f"{P}/rv-check", json=doc(example_yaml, "rv-check"))
    assert created.status_code in (200, 201)
    for bad in ("abc", "", "-1", "1.5", "²", HUGE, True, [1]):
        body = _status(bad_api.put(f"{P}/rv-check/status", json={"metadata": {"resourceVersion": bad},
                                                                   "status": {"message": "x"}}), 400)
        assert _fields(body) == ["metadata.resourceVersion"]
    rv = int(bad_api.get(f"{P}/rv-check").json()["metadata"]["resourceVersion"])
    _status(bad_api.put(f"{P}/rv-check/status", json={"metadata": {"resourceVersion": str(rv + 1000)},
                                                      "status": {"message": "x"}}), 409)
    for _ in range(20):  # the embedded operator writes the job too: a current version is one read just now
        ok = bad_api.put(f"{P}/rv-check/status", json={"metadata": {"resourceVersion": str(rv)},
                                                       "status": {"message": "y"}})
        if ok.status_code != 409:
            break
        rv = int(bad_api.get(f"{P}/rv-check").json()["metadata"]["resourceVersion"])
    assert ok.status_code == 200 and ok.json()["status"]["message"] == "y"


def test_malformed_label_selector_is_400_with_the_reason(bad_api):
    for sel in ("a b", "a=b=c", "!a=b", "a in (b", "a in ()", "=b", "a=b c", "ä=1", "a=" + "v" * 64):
        body = _status(bad_api.get(P, params={"labelSelector": sel}), 400)
        assert "labelSelector" in body["message"], sel
    for sel in ("team=rl", "team==rl,tier!=gold", "team,!tier", "example.com/team=rl", "team=", "team in (rl,x)"):
        assert bad_api.get(P, params={"labelSelector": sel}).status_code == 200, sel


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data", "http://[fe80::1]:8000",
                                 "http://0.0.0.0:8000", "http://2852039166/", "http://[::ffff:169.254.169.254]/",
                                 "http://metadata.google.internal/", "ftp://127.0.0.1/", "http://a\x00b/",
                                 "http://127.0.0.1\x00.example/", "http://host /", "http://h\tx/"])
def test_backend_urls_the_policy_refuses(bad_api, example_yaml, url):
    d = doc(example_yaml, "policy")
    d["spec"]["llm"]["backends"] = [{"url": "http://127.0.0.1:8000"}, {"url": url}]
    assert _fields(_status(bad_api.put(f"{P}/policy", json=d), 422)) == ["spec.llm.backends[1].url"]
    d["spec"]["llm"]["backends"] = d["spec"]["llm"]["backends"][:1]
    assert bad_api.put(f"{P}/policy", json=d).status_code in (200, 201)
    # runtime changes (`rolloutctl backends add`) take another route: the same policy
    assert _fields(_status(bad_api.post(f"{P}/policy/backends", json={"url": url}), 422)) == ["url"]
    assert [b["url"] for b in bad_api.get(f"{P}/policy/backends").json()["items"]] == ["http://127.0.0.1:8000"]


def test_tokenizer_outside_the_roots_is_refused(bad_api, example_yaml):
    d = doc(example_yaml, "tok")
    for bad in ("/etc/shadow", "../../etc", "~/.ssh", "/root/.cache/rolloutd/models/../../../etc"):
        d["spec"]["llm"]["tokenizer"] = bad
        assert _fields(_status(bad_api.put(f"{P}/tok", json=d), 422)) == ["spec.llm.tokenizer"], bad
    # tokenizers load offline only: a model hub name (or a relative path) is refused, naming the field
    for bad in ("HuggingFaceTB/SmolLM2-135M-Instruct", "models/smollm2"):
        d["spec"]["llm"]["tokenizer"] = bad
        assert _fields(_status(bad_api.put(f"{P}/tok", json=d), 422)) == ["spec.llm.tokenizer"], bad


def test_a_job_without_a_tokenizer_is_created_not_a_500(bad_api):
    """The oracle agent makes no LLM call and names no tokenizer: the policy check crashed on it (500)."""
    from pathlib import Path
    from rolloutd.crds.spec_paths import resolve_paths
    example = Path(__file__).resolve().parents[2] / "examples/harbor/oracle-job.yaml"
    oracle = resolve_paths(yaml.safe_load(example.read_text()), example.parent)  # as rolloutctl apply -f sends it
    oracle["metadata"]["name"] = "oracle-no-tokenizer"
    created = bad_api.post(P, json=oracle)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["agent"]["kind"] == "oracle"


def test_the_allow_lists_come_from_the_controllers_config(tmp_path, monkeypatch, example_yaml):
    monkeypatch.setenv("ROLLOUTD_BACKEND_ALLOW_NETS", "169.254.0.0/16")
    monkeypatch.setenv("ROLLOUTD_TOKENIZER_ROOTS", "/srv/tokenizers")
    c = ControllerProcess(tmp_path / "data").start()
    try:
        with c.client() as api:
            d = doc(example_yaml, "allowed")
            d["spec"]["llm"] = {"tokenizer": "/srv/tokenizers/smollm2", "backends": [{"url": "http://169.254.1.2:8000"}]}
            assert api.post(P, json=d).status_code == 201
            d["spec"]["llm"]["backends"] = [{"url": "http://[fe80::1]:8000"}]  # not in the allowed net
            assert _fields(_status(api.put(f"{P}/allowed", json=d), 422)) == ["spec.llm.backends[0].url"]
    finally:
        c.stop()


def test_other_bad_input_is_4xx(bad_api, example_yaml):
    _status(bad_api.get(f"{P}/a%00b"), 404)
    _status(bad_api.get(f"{P}/a%00b/trajectories"), 404)
    _status(bad_api.post(P, content=b"\xff\xfe{}", headers=JSON), 400)
    _status(bad_api.post(P, content=json.dumps(doc(example_yaml, "trail")) + " x", headers=JSON), 400)
    _status(bad_api.post(P, content=b"apiVersion: \x00\n", headers=YAML), 400)
    d = doc(example_yaml, "uni")
    d["metadata"]["labels"] = {"team": "ré"}
    assert _fields(_status(bad_api.post(P, json=d), 422)) == ["metadata.labels"]
    _status(bad_api.get(P, params={"labelSelector": "team=ré"}), 400)
    for params in ({"timeoutSeconds": "inf", "watch": "true"}, {"timeoutSeconds": "nan", "watch": "true"},
                   {"timeoutSeconds": "x"}):
        _status(bad_api.get(P, params=params), 400)
    assert bad_api.post(P, json=doc(example_yaml, "q")).status_code in (201, 409)
    for params in ({"limit": "abc"}, {"cursor": "-1"}, {"follow": "sure"}, {"timeoutSeconds": "-inf"}):
        _status(bad_api.get(f"{P}/q/trajectories", params=params), 400)


def test_cli_errors_are_one_line_and_exit_1(controller, example_yaml, tmp_path):
    f = tmp_path / "inf.yaml"
    f.write_text(example_yaml.replace("temperature: 1.0", "temperature: .inf"))
    r = ctl(controller, "apply", "-f", str(f))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "spec.agent.sampling.temperature" in r.stderr
    for env in ({"ROLLOUTD_SERVER": "http://[::1"}, {"ROLLOUTD_TOKEN": "", "ROLLOUTD_TOKEN_FILE": str(tmp_path / "no")}):
        for args in (("get", "rj"), ("trajectories", "x"), ("backends", "list", "x")):
            r = ctl(controller, *args, env=env)
            assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (args, r.stderr)
    r = ctl(controller, "get", "rj", "-l", "a b")
    assert r.returncode == 1 and "labelSelector" in r.stderr and "Traceback" not in r.stderr
    assert ctl(controller, "apply", "-f", "-", stdin=example_yaml).returncode == 0
    r = ctl(controller, "backends", "add", "math-demo", "http://169.254.169.254")
    assert r.returncode == 1 and "link-local" in r.stderr and r.stderr.count("\n") == 1, r.stderr
