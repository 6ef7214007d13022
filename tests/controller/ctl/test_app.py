"""`rolloutctl` end to end: a real controller process and the CLI as a subprocess."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import yaml

from support.controller_process import ctl


def test_apply_get_describe_delete(controller, example_yaml, tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(example_yaml)
    r = ctl(controller, "apply", "-f", str(f))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "rolloutjob.rolloutd.io/math-demo created"
    assert ctl(controller, "apply", "-f", str(f)).stdout.strip().endswith("unchanged")
    changed = example_yaml.replace("nodes: 2", "nodes: 3")
    assert ctl(controller, "apply", "-f", "-", stdin=changed).stdout.strip().endswith("configured")

    table = ctl(controller, "get", "rolloutjobs")
    assert table.returncode == 0
    header, row = table.stdout.splitlines()[:2]
    # kubectl's columns (crds/crd.py PRINTER_COLUMNS): NODES is the daemons registered, as kubectl prints it
    assert header.split() == ["NAME", "PHASE", "NODES", "SCORED", "AGENT-FAILED", "INFRA-FAILED", "TOTAL", "REWARD",
                              "AGE"]
    assert row.split()[:3] == ["math-demo", "Pending", "0"]
    assert "REQUESTED" in ctl(controller, "get", "rolloutjobs", "-o", "wide").stdout

    obj = json.loads(ctl(controller, "get", "rj", "math-demo", "-o", "json").stdout)
    assert obj["metadata"]["generation"] == 2 and obj["spec"]["executor"]["nodes"] == 3
    listing = yaml.safe_load(ctl(controller, "get", "rolloutjobs", "-l", "team=rl", "-o", "yaml").stdout)
    assert [i["metadata"]["name"] for i in listing["items"]] == ["math-demo"]
    assert "No resources found" in ctl(controller, "get", "rolloutjobs", "-l", "team=none").stderr

    desc = ctl(controller, "describe", "rolloutjob", "math-demo").stdout
    assert "Name:          math-demo" in desc and "Executor:    local, 3 node(s)" in desc
    assert "Conditions:" in desc and "Events:" in desc

    gone = ctl(controller, "delete", "rolloutjob", "math-demo", "--wait", "--timeout", "30s")
    assert gone.returncode == 0, gone.stderr
    assert "deleted" in gone.stdout
    missing = ctl(controller, "get", "rj", "math-demo")
    assert missing.returncode == 1 and "NotFound" in missing.stderr


def test_namespace_flag_keeps_one_name_apart_in_two_namespaces(controller, example_yaml):
    doc = example_yaml.replace("name: math-demo", "name: ns-demo")
    assert ctl(controller, "-n", "team-a", "apply", "-f", "-", stdin=doc).stdout.strip().endswith("created")
    assert ctl(controller, "apply", "-f", "-", stdin=doc).stdout.strip().endswith("created")  # `default`
    team = json.loads(ctl(controller, "--namespace", "team-a", "get", "rj", "ns-demo", "-o", "json").stdout)
    assert team["metadata"]["namespace"] == "team-a"
    env_team = yaml.safe_load(ctl(controller, "get", "rj", "-o", "yaml", env={"ROLLOUTD_NAMESPACE": "team-a"}).stdout)
    assert [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in env_team["items"]] == [("team-a", "ns-demo")]
    assert "Name:          ns-demo" in ctl(controller, "-n", "team-a", "describe", "rj", "ns-demo").stdout
    assert ctl(controller, "-n", "team-a", "delete", "rj", "ns-demo").returncode == 0
    left = json.loads(ctl(controller, "get", "rj", "ns-demo", "-o", "json").stdout)  # `default`'s is untouched
    assert "deletionTimestamp" not in left["metadata"]
    assert ctl(controller, "delete", "rj", "ns-demo").returncode == 0


def test_namespace_flag_after_the_verb(controller, example_yaml):
    doc = example_yaml.replace("name: math-demo", "name: ns-after")
    assert ctl(controller, "apply", "-f", "-", "-n", "team-b", stdin=doc).stdout.strip().endswith("created")
    assert ctl(controller, "get", "rj", "ns-after", "-n", "team-a").returncode == 1  # not in the other namespace
    for args in (("get", "rj", "ns-after", "-n", "team-b", "-o", "json"),
                 ("get", "rj", "ns-after", "--namespace=team-b", "-o", "json"),
                 ("get", "-nteam-b", "rj", "ns-after", "-o", "json")):
        r = ctl(controller, *args)
        assert r.returncode == 0, (args, r.stderr)
        assert json.loads(r.stdout)["metadata"]["namespace"] == "team-b"
    # after the verb it wins over the one before (kubectl: the last one given)
    r = ctl(controller, "-n", "team-a", "get", "rj", "ns-after", "-n", "team-b", "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["metadata"]["namespace"] == "team-b"
    assert ctl(controller, "get", "rj", "-n").returncode == 2  # no value: a usage error, not a crash
    assert ctl(controller, "delete", "rj", "ns-after", "--namespace", "team-b").returncode == 0


def test_bad_input_is_one_clear_line_and_exit_1(controller, example_yaml, tmp_path):
    bad = example_yaml.replace("maxTurns: 4", "maxTurnz: 4")
    r = ctl(controller, "apply", "-f", "-", stdin=bad)
    assert r.returncode == 1 and "spec.agent.maxTurnz" in r.stderr and "Traceback" not in r.stderr
    r = ctl(controller, "apply", "-f", "-", stdin="kind: [\n")
    assert r.returncode == 1 and "malformed YAML" in r.stderr
    r = ctl(controller, "apply", "-f", str(tmp_path / "absent.yaml"))
    assert r.returncode == 1 and "cannot read" in r.stderr
    r = ctl(controller, "get", "pods")
    assert r.returncode == 2 and "unknown resource type" in r.stderr


def test_wrong_token_and_unreachable_server(controller):
    r = ctl(controller, "get", "rj", env={"ROLLOUTD_TOKEN": "nope"})
    assert r.returncode == 1 and "Unauthorized" in r.stderr
    r = ctl(controller, "get", "rj", env={"ROLLOUTD_SERVER": "http://127.0.0.1:9"})
    assert r.returncode == 1 and "cannot reach the controller" in r.stderr


def test_token_file_and_config_file(controller, tmp_path):
    env = {"ROLLOUTD_TOKEN": ""}
    r = ctl(controller, "--token-file", str(controller.data_dir / "token"), "get", "rj", env=env)
    assert r.returncode == 0, r.stderr
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"server": controller.url, "tokenFile": str(controller.data_dir / "token")}))
    r = ctl(controller, "get", "rj", env={"ROLLOUTD_TOKEN": "", "ROLLOUTD_SERVER": "", "ROLLOUTD_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr


def test_wait_times_out_then_succeeds_when_condition_is_met(controller, example_yaml):
    ctl(controller, "apply", "-f", "-", stdin=example_yaml)
    r = ctl(controller, "wait", "rj", "math-demo", "--for=condition=Complete", "--timeout=1s")
    assert r.returncode == 3 and "timed out" in r.stderr

    # another party (the scheduler, later) completes the job while `wait` blocks
    result = {}

    def waiter():
        result["r"] = ctl(controller, "wait", "rj", "math-demo", "--for=condition=Complete", "--timeout=60s")

    t = threading.Thread(target=waiter)
    t.start()
    with controller.client() as api:
        # Whether this write lands before or after the waiter connects, the outcome is the same:
        # `wait` reads the object first, then watches from its resourceVersion, so nothing is missed.
        status = {"phase": "Succeeded", "conditions": [{"type": "Complete", "status": "True", "reason": "Done"}]}
        r = api.put("/apis/rolloutd.io/v1alpha1/rolloutjobs/math-demo/status", json={"status": status})
        assert r.status_code == 200
    t.join(60)
    assert result["r"].returncode == 0, result["r"].stderr
    assert "math-demo condition met" in result["r"].stdout


def test_wait_reports_failure(controller, example_yaml):
    ctl(controller, "apply", "-f", "-", stdin=example_yaml)
    with controller.client() as api:
        api.put("/apis/rolloutd.io/v1alpha1/rolloutjobs/math-demo/status", json={"status": {
            "phase": "Failed", "conditions": [{"type": "Complete", "status": "False", "reason": "Boom", "message": "all broke"}]}})
    r = ctl(controller, "wait", "rj", "math-demo", "--timeout=30s")
    assert r.returncode == 1 and "Failed" in r.stderr and "all broke" in r.stderr


def test_watch_shows_progress_until_the_end(controller, example_yaml):
    ctl(controller, "apply", "-f", "-", stdin=example_yaml)
    with controller.client() as api:
        api.put("/apis/rolloutd.io/v1alpha1/rolloutjobs/math-demo/status", json={"status": {
            "phase": "Succeeded", "counts": {"total": 8, "scored": 5, "agentFailed": 2, "infraFailed": 1,
                                             "succeeded": 7, "failed": 1}}})
    r = ctl(controller, "watch", "rj", "math-demo", "--timeout=30s")
    assert r.returncode == 0, r.stderr
    assert "phase Succeeded" in r.stdout
    # one vocabulary (scored / agent-failed / infra-failed / cancelled), as the status counts them
    assert re.search(r"scored\W+5\W", r.stdout) and re.search(r"agent-failed\W+2\W", r.stdout), r.stdout
    assert re.search(r"infra-failed\W+1\W", r.stdout) and "succeeded" not in r.stdout, r.stdout


def test_watch_into_a_file_prints_a_line_per_change_and_rides_through_a_restart(controller, example_yaml):
    applied = ctl(controller, "apply", "-f", "-", stdin=example_yaml)
    assert applied.returncode == 0, applied.stderr
    status = "/apis/rolloutd.io/v1alpha1/rolloutjobs/math-demo/status"
    e = {**os.environ, "ROLLOUTD_SERVER": controller.url, "ROLLOUTD_TOKEN": controller.token,
         "ROLLOUTD_CONFIG": str(controller.data_dir.parent / "no-config.yaml")}
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.ctl", "watch", "rj", "math-demo",
                             "--timeout=120s"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    try:
        assert "phase Pending" in proc.stdout.readline()      # at once, not when the job ends
        with controller.client() as api:
            api.put(status, json={"status": {"phase": "Running", "counts": {"total": 8, "run": 3, "queued": 5}}})
        assert "phase Running" in (running := proc.stdout.readline()) and "run=3" in running
        controller.restart()                                   # kill -9: the watch reconnects and resumes
        with controller.client() as api:
            api.put(status, json={"status": {"phase": "Succeeded", "counts": {"total": 8, "scored": 8}}})
        assert "phase Succeeded" in (done := proc.stdout.readline()) and "scored=8" in done
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()


def test_get_all_namespaces_and_delete_by_label(controller, example_yaml):
    for ns, name, team in (("team-a", "a1", "rl"), ("team-a", "a2", "other"), ("default", "d1", "rl")):
        doc = example_yaml.replace("name: math-demo", f"name: {name}").replace("team: rl", f"team: {team}")
        assert ctl(controller, "-n", ns, "apply", "-f", "-", stdin=doc).returncode == 0
    table = ctl(controller, "get", "rolloutjobs", "-A").stdout.splitlines()
    assert table[0].split()[:2] == ["NAMESPACE", "NAME"]
    assert sorted(tuple(r.split()[:2]) for r in table[1:]) == [("default", "d1"), ("team-a", "a1"), ("team-a", "a2")]
    gone = ctl(controller, "-n", "team-a", "delete", "rj", "-l", "team=rl", "--wait", "--timeout", "60s")
    assert gone.returncode == 0 and '"a1" deleted' in gone.stdout and "a2" not in gone.stdout, gone.stderr
    left = ctl(controller, "get", "rolloutjobs", "-A").stdout
    assert "a2" in left and "d1" in left and "a1" not in left
    assert ctl(controller, "delete", "rj").returncode == 2          # neither a name nor a selector


def test_tab_completes_job_names_from_the_controller(controller, example_yaml):
    for name in ("math-one", "math-two", "other"):
        ctl(controller, "apply", "-f", "-", stdin=example_yaml.replace("name: math-demo", f"name: {name}"))
    e = {**os.environ, "ROLLOUTD_SERVER": controller.url, "ROLLOUTD_TOKEN": controller.token,
         "ROLLOUTD_CONFIG": str(controller.data_dir.parent / "no-config.yaml"),
         "_ROLLOUTCTL_COMPLETE": "complete_bash", "COMP_WORDS": "rolloutctl describe rj math", "COMP_CWORD": "3"}
    from pathlib import Path

    rolloutctl = str(Path(sys.executable).parent / "rolloutctl")   # the installed command, as a shell runs it
    r = subprocess.run([rolloutctl], capture_output=True, text=True,
                       env={**e, "_TYPER_COMPLETE_ARGS": "rolloutctl describe rj math"}, timeout=60)
    assert r.stdout.split() == ["math-one", "math-two"], (r.stdout, r.stderr)
