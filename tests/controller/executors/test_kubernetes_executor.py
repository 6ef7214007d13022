"""executor.kind kubernetes: the Indexed Job it builds, checked against the Kubernetes 1.33 schemas
(kubernetes-validate, strict, offline), and its create / scale / observe / release calls made through
the real `kubernetes` client against a local HTTP double of the API server's batch/v1 Jobs, core/v1
Secrets and Pods endpoints, which records every request (a unit test of the executor's logic: no
live cluster runs here, see README "Kubernetes")."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import typer
import yaml

from rolloutd.crds.kit.settings import ControllerSettings
from rolloutd.controller.executors.logs import MAX_BYTES, NoLogs
from rolloutd.controller.executors.kubernetes.executor import INSTALL_HINT, KubernetesExecutor
from rolloutd.controller.executors.kubernetes.manifests import job_manifest, resource_name
from rolloutd.controller.executors.kubernetes.pods import node_states
from rolloutd.controller.main import app as rolloutd_app
from rolloutd.controller.executors.base import ExecutorError
from rolloutd.controller.operator.handlers import Reconciler
from rolloutd.controller.operator.kubeapi import Connection
from rolloutd.controller.server import build_app
from rolloutd.controller.store import Store
from rolloutd.crds.rolloutjob import RolloutJob

from support.apiserver_double import K8S_VERSION, FakeApiServer
from support.kube_tools import helm
from support.store_api import StoreApi, reconcile_all

REPO = Path(__file__).resolve().parents[3]
TOKEN = "join-secret-abc123"


class OneCredential:
    """The executors' credentials port with one fixed credential (tests/tenancy tests the real ones)."""

    def __init__(self) -> None:
        self.revoked: list[str] = []

    def mint(self, job: RolloutJob) -> str:
        return TOKEN

    def revoke(self, job: RolloutJob) -> None:
        self.revoked.append(job.metadata.key)


def make_job(name: str = "math-demo", nodes: int = 2, uid: str = "uid-1", **kube) -> RolloutJob:
    return RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name, "uid": uid},
        "spec": {"tasks": {"kind": "math", "source": "examples/math/train.jsonl"}, "agent": {"kind": "oracle"},
                 "executor": {"kind": "kubernetes", "nodes": nodes, "kubernetes": kube}}})


def validate(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


# ---------------------------------------------------------------- the manifest (pure)


@pytest.mark.parametrize("kube", [
    {},
    {"image": "registry.example/rolloutd:1", "imagePullPolicy": "Always", "namespace": "rl", "serviceAccount": "runner",
     "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}},
     "nodeSelector": {"pool": "cpu"}, "runAsUser": 4242},
    {"userNamespace": False, "seccompProfile": "RuntimeDefault", "appArmorProfile": "RuntimeDefault"},
], ids=["defaults", "every-knob", "no-userns"])
def test_indexed_job_is_valid_kubernetes(kube):
    job = make_job(nodes=3, **kube)
    m = job_manifest(job, namespace="rl", image="rolloutd:0.1.0", controller_url="http://ctl.rl.svc:7350")
    validate(m)
    spec, pod = m["spec"], m["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    container = pod["containers"][0]
    assert container["image"] == kube.get("image", "rolloutd:0.1.0")
    assert pod["securityContext"]["runAsUser"] == kube.get("runAsUser", 1000) and pod["securityContext"]["runAsNonRoot"]
    assert pod["securityContext"]["seccompProfile"]["type"] == kube.get("seccompProfile", "Unconfined")
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    userns = kube.get("userNamespace", True)
    assert (pod.get("hostUsers"), container["securityContext"].get("procMount")) == \
        ((False, "Unmasked") if userns else (None, None))


def test_indexed_job_speaks_the_daemons_contract():
    """The env and argv the local and Slurm executors give a daemon; the join token only by Secret reference."""
    job = make_job()
    m = job_manifest(job, namespace="rl", image="img", controller_url="http://ctl:7350", drain_seconds=45)
    assert TOKEN not in json.dumps(m)
    container = m["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["ROLLOUTD_CONTROLLER"]["value"] == "http://ctl:7350"
    assert env["ROLLOUTD_JOB"]["value"] == "math-demo"
    assert env["ROLLOUTD_JOIN_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "rolloutd-math-demo", "key": "join-token"}}
    assert env["ROLLOUTD_DRAIN_SECONDS"]["value"] == "45"
    assert m["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    # the command is one the real CLI accepts, with the completion index Kubernetes substitutes
    argv = [a.replace("$(JOB_COMPLETION_INDEX)", "2") for a in container["command"]]
    assert argv[0] == "rolloutd"
    params = typer.main.get_command(rolloutd_app).commands[argv[1]].make_context(argv[1], argv[2:]).params
    assert params["slot"] == 2
    # exit code 2 (refused by the controller) fails the Job instead of restarting the pod
    rules = m["spec"]["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In", "values": [2]}}


def test_long_job_names_give_valid_hostnames():
    name = "a" * 63
    job = make_job(name=name)
    m = job_manifest(job, namespace="rl", image="img", controller_url="http://c:1")
    validate(m)
    assert len(f"{resource_name(name)}-4095") <= 63
    assert resource_name(name) != resource_name("a" * 62)


def test_a_job_outside_default_gets_its_own_valid_resources_and_its_key_in_the_contract():
    job = RolloutJob.model_validate({**make_job("j").wire(), "metadata": {"name": "j", "namespace": "a-b", "uid": "u"}})
    m = job_manifest(job, namespace="rl", image="img", controller_url="http://c:1")
    validate(m)
    names = {resource_name(k) for k in ("j", "a-b/j", "a/b-j")}  # "a-b/j" and "a/b-j" must not meet
    assert len(names) == 3 and not any("/" in n for n in names) and m["metadata"]["name"] == resource_name("a-b/j")
    env = {e["name"]: e.get("value") for e in m["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ROLLOUTD_JOB"] == "a-b/j" and m["metadata"]["labels"]["rolloutd.io/namespace"] == "a-b"


def test_spec_refuses_what_kubernetes_would():
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        make_job(resources={"requests": {"memory": "8 GB"}})
    with pytest.raises(ValueError, match="namespace"):
        make_job(namespace="Not_A_Namespace")
    with pytest.raises(ValueError, match="runAsUser"):
        make_job(runAsUser=0)


def test_node_states_map_pods_by_index():
    def pod(index, phase, created, **status):
        return {"metadata": {"name": f"p{index}-{created}", "creationTimestamp": created,
                             "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}},
                "status": {"phase": phase, **status}}
    pods = [
        pod(0, "Running", "2026-01-01T00:00:01Z"),
        pod(1, "Pending", "2026-01-01T00:00:01Z", containerStatuses=[
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]),
        pod(2, "Failed", "2026-01-01T00:00:01Z", containerStatuses=[
            {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]),
        pod(2, "Running", "2026-01-01T00:00:09Z"),  # the Job's replacement for the failed one
        pod(3, "Pending", "2026-01-01T00:00:01Z", conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes are available"}]),
        pod(4, "Failed", "2026-01-01T00:00:01Z", containerStatuses=[{"state": {"terminated": {"exitCode": 1}}}]),
    ]
    got = [(n.name, n.state, n.reason) for n in node_states("rolloutd-x", pods)]
    assert got == [
        ("rolloutd-x-0", "running", ""),
        ("rolloutd-x-1", "pending", "ImagePullBackOff: pull access denied"),
        ("rolloutd-x-2", "running", ""),
        ("rolloutd-x-3", "pending", "Unschedulable: 0/3 nodes are available"),
        ("rolloutd-x-4", "lost", "exited with code 1"),
    ]


# ---------------------------------------------------------------- through the client, against the double


@pytest.fixture
def apiserver():
    server = FakeApiServer()
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def client_for(url: str):
    from kubernetes import client

    def make():
        conf = client.Configuration()
        conf.host = url
        return client.ApiClient(conf)
    return make


def executor(url: str) -> KubernetesExecutor:
    return KubernetesExecutor("http://rolloutd.rolloutd.svc:7350", OneCredential(), namespace="rl", image="rolloutd:0.1.0",
                              drain_seconds=30, api_client=client_for(url))


JOBS, SECRETS, PODS = "/apis/batch/v1/namespaces/rl/jobs", "/api/v1/namespaces/rl/secrets", "/api/v1/namespaces/rl/pods"


def test_create_scale_observe_release_through_the_client(apiserver):
    ex, job = executor(apiserver.url), make_job(nodes=2)
    name = "rolloutd-math-demo"

    async def go():
        await ex.ensure(job, 2)
        assert apiserver.calls() == [("GET", f"{JOBS}/{name}"), ("POST", SECRETS), ("POST", JOBS)]
        assert apiserver.secrets[("rl", name)]["stringData"] == {"join-token": TOKEN}
        created = apiserver.jobs[("rl", name)]
        assert created["spec"] == job_manifest(job, namespace="rl", image="rolloutd:0.1.0",
                                               controller_url="http://rolloutd.rolloutd.svc:7350")["spec"]

        await ex.ensure(job, 2)  # level-triggered: already there, nothing written
        assert apiserver.calls() == [("GET", f"{JOBS}/{name}")]

        await ex.ensure(job, 3)  # elastic Indexed Job: parallelism and completions together
        patch = [r for r in apiserver.requests if r["method"] == "PATCH"]
        assert apiserver.calls() == [("GET", f"{JOBS}/{name}"), ("PATCH", f"{JOBS}/{name}")]
        assert patch[0]["contentType"] == "application/merge-patch+json"
        assert patch[0]["body"] == {"spec": {"parallelism": 3, "completions": 3}}

        apiserver.add_pod(name, 0, "Running")
        apiserver.add_pod(name, 1, "Pending")
        apiserver.add_pod("rolloutd-other", 0, "Running")
        nodes = await ex.observe(job)
        assert [(n.name, n.state) for n in nodes] == [(f"{name}-0", "running"), (f"{name}-1", "pending")]
        listed = apiserver.requests[-1]
        assert listed["path"] == PODS and listed["query"]["labelSelector"] == [f"batch.kubernetes.io/job-name={name}"]
        apiserver.calls()

        await ex.release(job)
        deletes = [r for r in apiserver.requests if r["method"] == "DELETE"]
        assert apiserver.calls() == [("DELETE", f"{JOBS}/{name}"), ("DELETE", f"{SECRETS}/{name}")]
        assert deletes[0]["query"]["propagationPolicy"] == ["Background"]
        assert not apiserver.jobs and not apiserver.secrets and ex.credentials.revoked == ["math-demo"]
        await ex.release(job)  # the reconciler calls release on every pass over a finished job
        assert apiserver.calls() == []

    asyncio.run(go())


def test_logs_read_each_indexs_newest_pod_through_the_api_bounded(apiserver):
    """`rolloutctl logs` on the kubernetes executor: the `node` container's log of each index's newest pod."""
    ex, job, name = executor(apiserver.url), make_job(nodes=2), "rolloutd-math-demo"
    apiserver.add_pod(name, 0, "Running")
    apiserver.add_pod(name, 1, "Running")
    apiserver.add_pod("rolloutd-other", 0, "Running")  # another job's pod: never read
    apiserver.logs.update({f"{name}-0-x": "a\nb\nc\n", f"{name}-1-x": "d\n", "rolloutd-other-0-x": "secret\n"})

    async def read(node, tail):
        return "".join([chunk async for chunk in await ex.logs(job, node, tail, False)])

    async def go():
        assert await read(0, 2) == "b\nc\n"
        assert sorted((await read(None, 200)).splitlines()) == ["[node0] a", "[node0] b", "[node0] c", "[node1] d"]
        with pytest.raises(NoLogs, match="no pod for node 5"):
            await ex.logs(job, 5, 10, False)
        # followed: a stream read as it comes, which ends when the API server ends it (the container exited)
        assert await read_followed(0) == "a\nb\nc\n"

    async def read_followed(node):
        return "".join([chunk async for chunk in await ex.logs(job, node, 10, True)])

    asyncio.run(go())
    reads = [r for r in apiserver.requests if r["path"].endswith("/log")]
    assert [r["path"] for r in reads] == [f"{PODS}/{name}-0-x/log", f"{PODS}/{name}-0-x/log", f"{PODS}/{name}-1-x/log",
                                          f"{PODS}/{name}-0-x/log"]
    assert reads[-1]["query"]["follow"] == ["true"] and reads[0]["query"]["follow"] == ["false"]
    assert reads[0]["query"]["container"] == ["node"] and reads[0]["query"]["tailLines"] == ["2"]
    assert reads[0]["query"]["limitBytes"] == [str(MAX_BYTES)]


def test_a_leftover_secret_is_overwritten_and_an_earlier_jobs_job_replaced(apiserver):
    ex = executor(apiserver.url)
    name = "rolloutd-math-demo"
    apiserver.secrets[("rl", name)] = {"metadata": {"name": name}, "stringData": {"join-token": "old"}}

    async def go():
        await ex.ensure(make_job(uid="uid-1"), 1)
        assert apiserver.secrets[("rl", name)]["stringData"] == {"join-token": TOKEN}
        apiserver.calls()
        with pytest.raises(ExecutorError, match="earlier RolloutJob") as e:  # same name, new uid
            await ex.ensure(make_job(uid="uid-2"), 1)
        assert not e.value.permanent and not apiserver.jobs
        await ex.ensure(make_job(uid="uid-2"), 1)
        assert apiserver.jobs[("rl", name)]["metadata"]["labels"]["rolloutd.io/uid"] == "uid-2"

    asyncio.run(go())


def test_refusals_fail_the_job_drained_or_unreachable_is_retried(apiserver):
    ex = executor(apiserver.url)
    apiserver.forbidden.add("locked")

    async def go():
        with pytest.raises(ExecutorError, match='cannot .* in the namespace "locked"') as e:
            await ex.ensure(make_job(namespace="locked"), 1)
        assert e.value.permanent and e.value.reason == "KubernetesForbidden"

        await ex.ensure(make_job(), 1)
        apiserver.jobs[("rl", "rolloutd-math-demo")]["status"] = {"conditions": [
            {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
             "message": "Container node for pod rl/rolloutd-math-demo-0-abc failed with exit code 2"}]}
        with pytest.raises(ExecutorError, match="exit code 2") as e:
            await ex.ensure(make_job(), 1)
        assert e.value.permanent and e.value.reason == "KubernetesJobFailed"

        apiserver.jobs[("rl", "rolloutd-math-demo")]["status"] = {"conditions": [
            {"type": "Complete", "status": "True", "reason": "CompletionsReached"}]}
        with pytest.raises(ExecutorError, match="replacing the Job") as e:  # drained daemons, rollouts left
            await ex.ensure(make_job(), 1)
        assert not e.value.permanent and not apiserver.jobs
        await ex.ensure(make_job(), 1)
        assert ("rl", "rolloutd-math-demo") in apiserver.jobs

        down = executor("http://127.0.0.1:9")  # nothing listens: transient, the next pass tries again
        with pytest.raises(ExecutorError, match="reading Job") as e:
            await down.ensure(make_job(), 1)
        assert not e.value.permanent and e.value.reason == "KubernetesUnreachable"

    asyncio.run(go())


def test_operator_mode_runs_the_daemons_in_the_rolloutjobs_own_namespace(apiserver, tmp_path):
    """`rolloutd operator --kubeconfig`: the Job and its Secret go to the RolloutJob's namespace on the
    kubeconfig's cluster (with its token), owned by the RolloutJob; the controller's namespace is not used."""
    settings = ControllerSettings(k8s_namespace="rl",  # the controller's own: only the embedded mode's default
                                  k8s_node_image="rolloutd:0.1.0")
    app = build_app(tmp_path / "data", executors=("kubernetes",), kube=Connection(apiserver.url, "op-token"),
                    settings=settings)
    ex = app.root.executors["kubernetes"]
    job = RolloutJob.model_validate({**make_job("j", uid="uid-9").wire(),
                                     "metadata": {"name": "j", "namespace": "team-a", "uid": "uid-9"}})
    name = resource_name("team-a/j")
    jobs, secrets = "/apis/batch/v1/namespaces/team-a/jobs", "/api/v1/namespaces/team-a/secrets"

    async def go():
        await ex.ensure(job, 2)
        assert {r["authorization"] for r in apiserver.requests} == {"Bearer op-token"}
        assert apiserver.calls() == [("GET", f"{jobs}/{name}"), ("POST", secrets), ("POST", jobs)]
        created, secret = apiserver.jobs[("team-a", name)], apiserver.secrets[("team-a", name)]
        validate({k: v for k, v in created.items() if k != "status"})
        owner = [{"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "name": "j", "uid": "uid-9",
                  "controller": True, "blockOwnerDeletion": False}]
        assert created["metadata"]["ownerReferences"] == owner and secret["metadata"]["ownerReferences"] == owner
        await ex.release(job)
        assert apiserver.calls() == [("DELETE", f"{jobs}/{name}"), ("DELETE", f"{secrets}/{name}")]

        elsewhere = RolloutJob.model_validate({**make_job("k", uid="uid-10", namespace="rl").wire(),
                                               "metadata": {"name": "k", "namespace": "team-a", "uid": "uid-10"}})
        await ex.ensure(elsewhere, 1)  # spec.executor.kubernetes.namespace wins; no owner across namespaces
        other = apiserver.jobs[("rl", resource_name("team-a/k"))]
        assert "ownerReferences" not in other["metadata"]

        embedded = executor(apiserver.url)  # `rolloutd controller`: its RolloutJobs are not the cluster's objects
        apiserver.calls()
        await embedded.ensure(job, 1)
        assert ("POST", "/apis/batch/v1/namespaces/rl/jobs") in apiserver.calls()
        assert "ownerReferences" not in apiserver.jobs[("rl", name)]["metadata"]

    asyncio.run(go())


def test_reconciler_runs_and_releases_a_kubernetes_job(apiserver, tmp_path):
    """The operator's reconcile pass with this executor: Job created on apply, deleted on delete."""
    store = Store(tmp_path / "db.sqlite")
    job = make_job(nodes=2)
    store.apply(job)
    rec = Reconciler(StoreApi(store), {"kubernetes": executor(apiserver.url)})

    async def go():
        await reconcile_all(rec)
        assert store.get("math-demo").status.phase.value == "Provisioning"
        assert ("rl", "rolloutd-math-demo") in apiserver.jobs
        apiserver.add_pod("rolloutd-math-demo", 0, "Running")
        await reconcile_all(rec)
        assert store.get("math-demo").status.phase.value == "Running"
        store.mark_deleted("math-demo")
        await reconcile_all(rec)
        assert not apiserver.jobs and not apiserver.secrets
        assert "math-demo" not in list(store.names())

    asyncio.run(go())


def test_without_the_client_a_job_fails_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` raises ImportError
    store = Store(tmp_path / "db.sqlite")
    store.apply(make_job())
    rec = Reconciler(StoreApi(store), {"kubernetes": KubernetesExecutor("http://c:7350", OneCredential(), namespace="rl", image="i")})
    asyncio.run(reconcile_all(rec))
    status = store.get("math-demo").status
    assert status.phase.value == "Failed"
    assert INSTALL_HINT in status.condition("Failed").message
    events = len(store.events("math-demo"))
    asyncio.run(reconcile_all(rec))  # a failed job is released on every pass: no error loop
    assert len(store.events("math-demo")) == events
    store.mark_deleted("math-demo")
    asyncio.run(reconcile_all(rec))
    assert "math-demo" not in list(store.names())


def test_the_core_does_not_import_the_client():
    code = ("import sys; import rolloutd.controller.executors.kubernetes.executor; "
            "assert 'kubernetes' not in sys.modules, 'kubernetes imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chart_rbac_allows_exactly_the_executors_calls(apiserver, tmp_path):
    """Every request the executor makes is granted by the chart's Role, and the Role grants nothing more."""
    ex, job = executor(apiserver.url), make_job(nodes=1)
    apiserver.secrets[("rl", "rolloutd-math-demo")] = {"metadata": {"name": "rolloutd-math-demo"}}  # → update

    async def go():
        await ex.ensure(job, 1)
        await ex.ensure(job, 2)
        await ex.observe(job)
        apiserver.add_pod("rolloutd-math-demo", 0, "Running")
        apiserver.logs["rolloutd-math-demo-0-x"] = "ok\n"
        async for _ in await ex.logs(job, None, 10, False):
            pass
        await ex.release(job)

    asyncio.run(go())
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
    used = set()
    for r in apiserver.requests:
        parts = r["path"].strip("/").split("/")
        group, resource = ("", parts[4]) if parts[0] == "api" else (parts[1], parts[5])
        if parts[-1] == "log":  # the pods/log subresource
            resource += "/log"
        named = len(parts) > (5 if parts[0] == "api" else 6)
        used.add((group, resource, verb.get(r["method"], "get" if named else "list")))
    rendered = subprocess.run([helm(), "template", "r", str(REPO / "charts" / "rolloutd"), "-n", "rl"],
                              check=True, capture_output=True, text=True).stdout
    role = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Role")
    granted = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for v in rule["verbs"]}
    assert used == granted
