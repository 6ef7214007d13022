"""kubectl against a running controller: the Kubernetes API the controller serves, seen by the real client."""
from __future__ import annotations

import subprocess
import threading

import yaml
from support.example_job import example_yaml
from support.kube_helpers import EXAMPLE, job_yaml, set_status
from support.waiting import wait_until

from rolloutd.controller.store import Store


def test_apply_client_side_then_server_side(kube, kubectl, tmp_path):
    # kubectl sends paths as they are, and the API refuses relative ones: the example with its paths resolved
    example = tmp_path / "math-demo.yaml"
    example.write_text(example_yaml())
    assert "spec.llm.tokenizer: 'smollm2' is not a tokenizer directory" in kubectl("apply", "-f", str(EXAMPLE), check=False).stderr
    assert "rolloutjob.rolloutd.io/math-demo created" in kubectl("apply", "-f", str(example)).stdout
    again = kubectl("apply", "-f", str(example)).stdout
    assert "math-demo" in again and ("configured" in again or "unchanged" in again)
    assert "serverside-applied" in kubectl("apply", "--server-side", "-f", str(example)).stdout
    table = kubectl("get", "rj").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "NODES", "SCORED", "AGENT-FAILED", "INFRA-FAILED", "TOTAL",
                                "REWARD", "AGE"]  # rolloutctl get prints the same (crds/crd.py PRINTER_COLUMNS)
    assert table[1].split()[:3] == ["math-demo", "Pending", "0"]
    job = yaml.safe_load(kubectl("get", "rj", "math-demo", "-o", "yaml", "--show-managed-fields").stdout)
    meta = job["metadata"]
    assert meta["namespace"] == "default" and meta["uid"] and meta["generation"] == 1
    assert "rolloutd.io/release" in meta["finalizers"]
    managers = {(m["manager"], m["operation"]) for m in meta["managedFields"]}
    assert ("kubectl", "Apply") in managers and ("kubectl-client-side-apply", "Update") in managers
    assert job["spec"]["tasks"]["kind"] == "math" and job["status"]["phase"] == "Pending"


def test_server_side_apply_conflict_and_force(kube, kubectl):
    kubectl("apply", "--server-side", "--field-manager=alice", "-f", "-", input=job_yaml("ssa-job"))
    changed = job_yaml("ssa-job").replace("nodes: 2", "nodes: 3")
    conflict = kubectl("apply", "--server-side", "--field-manager=bob", "-f", "-", input=changed, check=False)
    assert conflict.returncode != 0 and 'conflict with "alice"' in conflict.stderr and "spec.executor.nodes" in conflict.stderr
    kubectl("apply", "--server-side", "--field-manager=bob", "--force-conflicts", "-f", "-", input=changed)
    assert kubectl("get", "rj", "ssa-job", "-o", "jsonpath={.spec.executor.nodes}").stdout == "3"


def test_get_watch_sees_phase_transitions(kube, kubectl):
    kubectl("apply", "-f", "-", input=job_yaml("watched"))
    proc = subprocess.Popen([kubectl.binary, "get", "rj", "watched", "-w"], stdout=subprocess.PIPE, text=True,
                            env=kubectl.env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("Pending" in line for line in lines), 30, "the watch's first row")
        for phase in ("Provisioning", "Running", "Succeeded"):
            with kube.client() as api:
                set_status(api, "watched", {"phase": phase})
            wait_until(lambda: any(phase in line for line in lines), 30, f"kubectl get -w to print {phase}")
    finally:
        proc.kill()
        proc.wait()
    phases = [line.split()[1] for line in lines if line.startswith("watched")]
    assert phases[0] == "Pending" and phases.index("Provisioning") < phases.index("Running") < phases.index("Succeeded")


def test_describe_shows_the_jobs_events(kube, kubectl):
    kubectl("apply", "-f", "-", input=job_yaml("described"))
    store = Store(kube.data_dir / "rolloutd.db")  # the same database, written as the reconciler writes events
    store.add_event("described", "Provisioning", "requested 2 node(s) from local")
    store.add_event("described", "Failed", "backend refused the request", "Warning")
    out = kubectl("describe", "rj", "described").stdout
    events = out[out.index("Events:"):]
    assert "Provisioning" in events and "requested 2 node(s) from local" in events
    assert "Warning" in events and "backend refused the request" in events


def test_explain_reads_the_schema(kubectl):
    out = kubectl("explain", "rolloutjob.spec.agent").stdout
    assert "KIND:       RolloutJob" in out and "maxTurns" in out and "sampling" in out
    assert "harness" in kubectl("explain", "rj.spec.agent.kind").stdout


def test_wait_for_condition_complete(kube, kubectl):
    kubectl("apply", "-f", "-", input=job_yaml("waited"))
    proc = subprocess.Popen([kubectl.binary, "wait", "rj/waited", "--for=condition=Complete", "--timeout=60s"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=kubectl.env)
    try:  # whether kubectl lists the job before or after the condition is set, it must see it met
        with kube.client() as api:
            # observedGeneration as an operator writes it: kubectl ignores conditions of an older generation
            set_status(api, "waited", {"phase": "Succeeded", "observedGeneration": 1, "conditions": [
                {"type": "Complete", "status": "True", "reason": "Succeeded", "message": "4 rollouts finished"}]})
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "rolloutjob.rolloutd.io/waited condition met" in out


def test_patch_label_annotate(kube, kubectl):
    kubectl("apply", "-f", "-", input=job_yaml("patched"))
    kubectl("patch", "rj", "patched", "--type=merge", "-p",
            '{"spec":{"llm":{"backends":[{"url":"http://127.0.0.1:8001"}]}}}')
    assert kubectl("get", "rj", "patched", "-o", "jsonpath={.spec.llm.backends[*].url}").stdout == "http://127.0.0.1:8001"
    assert kubectl("get", "rj", "patched", "-o", "jsonpath={.metadata.generation}").stdout == "2"
    kubectl("label", "rj", "patched", "env=dev")
    kubectl("annotate", "rj", "patched", "owner=rl-team")
    assert "patched" in kubectl("get", "rj", "-l", "env in (dev,prod)", "-o", "name").stdout
    assert "patched" not in kubectl("get", "rj", "-l", "env!=dev", "-o", "name").stdout
    assert kubectl("get", "rj", "patched", "-o", "jsonpath={.metadata.annotations.owner}").stdout == "rl-team"


def test_delete_is_held_by_a_finalizer(kube, kubectl):
    kubectl("apply", "-f", "-", input=job_yaml("held"))
    kubectl("patch", "rj", "held", "--type=json", "-p",
            '[{"op":"add","path":"/metadata/finalizers/-","value":"example.com/hold"}]')
    kubectl("delete", "rj", "held", "--wait=false")

    def released():
        meta = yaml.safe_load(kubectl("get", "rj", "held", "-o", "yaml").stdout)["metadata"]
        return meta if meta.get("finalizers") == ["example.com/hold"] else None
    meta = wait_until(released, 30, "the reconciler to release the job and drop its own finalizer")
    assert meta["deletionTimestamp"]
    kubectl("patch", "rj", "held", "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    gone = kubectl("get", "rj", "held", check=False)
    assert gone.returncode != 0 and 'rolloutjobs.rolloutd.io "held" not found' in gone.stderr


def test_namespaces_and_server_dry_run(kube, kubectl):
    dry = kubectl("apply", "-n", "team-a", "--dry-run=server", "-f", "-", input=job_yaml("in-a"))
    assert "created (server dry run)" in dry.stdout
    assert "in-a" not in kubectl("get", "rj", "-n", "team-a", "-o", "name").stdout
    kubectl("apply", "-n", "team-a", "-f", "-", input=job_yaml("in-a"))
    assert "in-a" in kubectl("get", "rj", "-n", "team-a", "-o", "name").stdout
    assert "in-a" not in kubectl("get", "rj", "-n", "default", "-o", "name").stdout
    everywhere = kubectl("get", "rj", "-A").stdout.splitlines()
    assert everywhere[0].split()[0] == "NAMESPACE" and any(line.split()[:2] == ["team-a", "in-a"] for line in everywhere)
    assert "team-a" in kubectl("get", "namespaces", "-o", "name").stdout
    dry_delete = kubectl("delete", "rj", "in-a", "-n", "team-a", "--dry-run=server")
    assert "server dry run" in dry_delete.stdout
    assert kubectl("get", "rj", "in-a", "-n", "team-a", "-o", "jsonpath={.metadata.deletionTimestamp}").stdout == ""


def test_bad_input_is_a_clear_4xx(kubectl):
    unknown = job_yaml("bad-one").replace("maxTurns: 4", "maxTurn: 4")
    r = kubectl("apply", "-f", "-", input=unknown, check=False)
    assert r.returncode == 1 and "spec.agent.maxTurn" in r.stderr and "unknown field" in r.stderr
    bad_name = job_yaml("Bad_Name")
    r = kubectl("apply", "-f", "-", input=bad_name, check=False)
    assert r.returncode == 1 and "metadata.name" in r.stderr and "DNS-1123" in r.stderr
    kubectl("apply", "-f", "-", input=job_yaml("immutable"))
    r = kubectl("patch", "rj", "immutable", "--type=merge", "-p", '{"spec":{"tasks":{"kind":"code"}}}', check=False)
    assert r.returncode == 1 and "spec.tasks" in r.stderr and "immutable" in r.stderr
    r = kubectl("get", "rj", "-l", "a b", check=False)
    assert r.returncode == 1 and "labelSelector" in r.stderr
    r = kubectl("get", "--raw", "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs?limit=x", check=False)
    assert r.returncode == 1 and "limit must be a non-negative integer" in r.stderr


def test_create_with_generate_name_makes_a_new_job_each_time(kube, kubectl):
    doc = yaml.safe_load(job_yaml("unused"))
    del doc["metadata"]["name"]
    doc["metadata"]["generateName"] = "sweep-"
    text = yaml.safe_dump(doc)
    made = {kubectl("create", "-f", "-", "-o", "name", input=text).stdout.strip() for _ in range(3)}
    assert len(made) == 3 and all(m.startswith("rolloutjob.rolloutd.io/sweep-") for m in made), made
    name = sorted(made)[0].split("/")[1]
    assert len(name) == len("sweep-") + 5 and kubectl("get", "rj", name, "-o", "name").stdout.strip() == sorted(made)[0]
    doc["metadata"]["generateName"] = "Sweep_"
    bad = kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert bad.returncode != 0 and "metadata.generateName" in bad.stderr, bad.stderr
    del doc["metadata"]["generateName"]
    nameless = kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert nameless.returncode != 0 and "name" in nameless.stderr, nameless.stderr


def test_annotations_are_bounded_as_kubernetes_bounds_them(kube):
    with kube.client() as api:
        doc = yaml.safe_load(job_yaml("noted"))
        doc["metadata"]["annotations"] = {"example.com/note": "x" * (256 * 1024)}
        r = api.post("/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs", json=doc)
        assert r.status_code == 422 and "metadata.annotations" in r.text and "262144" in r.text, r.text
        doc["metadata"]["annotations"] = {"example.com/note": "x" * 1000}
        assert api.post("/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs", json=doc).status_code == 201
