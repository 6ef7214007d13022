"""charts/rolloutd with the real helm binary: `helm lint --strict`, `helm template` with several value
sets, every rendered manifest validated strictly against the Kubernetes 1.33 schemas
(kubernetes-validate, offline), and the wiring checked against the code it starts (the controller's
CLI parses the Deployment's arguments; the executor reads its environment)."""
from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import typer
import yaml

from rolloutd.crds.kit.settings import ControllerSettings
from rolloutd.controller.executors.kubernetes.executor import KubernetesExecutor
from rolloutd.controller.executors.base import advertised_url
from rolloutd.controller.main import app as rolloutd_app
from rolloutd.controller.operator.kubeapi import Connection
from rolloutd.controller.server import EXECUTOR_KINDS
from rolloutd.crds.crd import render_crd

from support.kube_tools import helm

K8S_VERSION = "1.33"  # the oldest Kubernetes the chart supports (kubeVersion in Chart.yaml)
CHART = Path(__file__).resolve().parents[2] / "charts" / "rolloutd"
NS = "rl"
# Third-party kinds kubernetes-validate has no schema for (it knows Kubernetes' own kinds only)
THIRD_PARTY = {"ServiceMonitor": "a Prometheus Operator CRD (monitoring.coreos.com/v1)"}

VALUE_SETS = {
    "defaults": {},
    "service-monitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    "executor-backends": {
        "image": {"repository": "registry.example/rolloutd", "tag": "9"},
        "executor": {"kinds": ["kubernetes", "local"],
                     "kubernetes": {"namespace": "rl-jobs", "extraNamespaces": ["rl-b"], "image": "registry.example/node:2"}},
        "backends": {"allowNets": ["169.254.0.0/16", "fd00::/8"], "tokenizerRoots": ["/models", "/hf"]},
        "storage": {"size": "50Gi", "storageClassName": "fast"},
        "controller": {"extraEnv": [{"name": "ROLLOUTD_DRAIN_SECONDS", "value": "60"}],
                       "extraVolumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets"}}],
                       "extraVolumeMounts": [{"name": "datasets", "mountPath": "/datasets", "readOnly": True}]},
    },
    "operator": {"mode": "operator"},
    "postgresql": {"database": {"existingSecret": "rolloutd-db", "key": "uri"}},
    "replicas": {"controller": {"replicas": 3}, "database": {"existingSecret": "rolloutd-db"},
                 "storage": {"accessModes": ["ReadWriteMany"]}},
    "bring-your-own": {"auth": {"existingSecret": "my-tokens"}, "storage": {"existingClaim": "my-pvc"},
                       "executor": {"kinds": ["local"]}, "serviceAccount": {"create": False, "name": "builder"}},
}


def _values_file(tmp: Path, values: dict) -> Path:
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@functools.lru_cache(maxsize=None)
def render(name: str) -> tuple[dict, ...]:
    """`helm template` (with the CRD) of one value set → its manifests."""
    out = subprocess.run([helm(), "template", "r", str(CHART), "-n", NS, "--include-crds", "-f", "-"],
                         input=yaml.safe_dump(VALUE_SETS[name]), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(docs, kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s rendered"
    return found[0]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict(name, tmp_path):
    out = subprocess.run([helm(), "lint", "--strict", str(CHART), "-f", str(_values_file(tmp_path, VALUE_SETS[name]))],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_is_valid_kubernetes(name):
    checked, skipped = [], []
    for doc in render(name):
        if doc["kind"] in THIRD_PARTY:
            skipped.append(doc["kind"])
            continue
        if doc["kind"] == "CustomResourceDefinition":
            continue  # test_chart_crd_is_valid_kubernetes
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked.append(doc["kind"])
    assert {"Deployment", "Service"} <= set(checked)
    assert skipped == (["ServiceMonitor"] if name == "service-monitor" else [])


def test_a_manifest_kubernetes_would_refuse_is_caught():
    """The check is strict: an unknown field (a typo) fails it."""
    deployment = json.loads(json.dumps(one(render("defaults"), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContex"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_schema_check_needs_no_network(monkeypatch):
    """kubernetes-validate reads the schemas it bundles: with every connection refused it still validates."""
    import socket

    def refuse(*a, **k):
        raise OSError("network disabled in this test")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert kubernetes_validate.validate(one(render("defaults"), "Deployment"), K8S_VERSION, strict=True) == K8S_VERSION


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / "rolloutjob.yaml").read_text() == render_crd(), \
        "charts/rolloutd/crds/rolloutjob.yaml is stale: run `rolloutd crd` (it writes both copies)"
    assert one(render("defaults"), "CustomResourceDefinition")["metadata"]["name"] == "rolloutjobs.rolloutd.io"


def test_chart_crd_is_valid_kubernetes():
    kubernetes_validate.validate(one(render("defaults"), "CustomResourceDefinition"), K8S_VERSION, strict=True)


def test_deployment_starts_the_real_controller():
    docs = render("defaults")
    dep, svc = one(docs, "Deployment"), one(docs, "Service")
    pod = dep["spec"]["template"]["spec"]
    ctl = pod["containers"][0]
    # the controller's own CLI parses the arguments (unknown options or bad values would raise)
    assert ctl["command"] == ["rolloutd", "controller"]
    params = typer.main.get_command(rolloutd_app).commands["controller"].make_context("controller", ctl["args"]).params
    assert str(params["data_dir"]) == "/data/rolloutd" and params["host"] == "0.0.0.0"
    assert params["executors"] == "kubernetes" and set(params["executors"].split(",")) <= set(EXECUTOR_KINDS)
    # its tokens are in that data dir before it starts (copied from the Secret by the init container)
    init = " ".join(pod["initContainers"][0]["command"])
    assert "/data/rolloutd/token" in init and "join-token" not in init  # node credentials are per job
    secret = one(docs, "Secret")
    assert {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v} == {secret["metadata"]["name"]}
    assert set(secret["data"]) == {"token"}
    assert {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v} == \
        {one(docs, "PersistentVolumeClaim")["metadata"]["name"]}
    # the Service reaches it, and the kubernetes executor tells node daemons that Service's address
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] in {p["name"] for p in ctl["ports"]}
    settings = ControllerSettings.from_env(env_of(ctl))  # what the controller reads as it starts
    ex = KubernetesExecutor(advertised_url(params["host"], params["port"], url=settings.advertise_url), "t",
                            namespace=settings.k8s_namespace, image=settings.k8s_node_image)
    assert ex.controller_url == f"http://{svc['metadata']['name']}.{NS}.svc:{svc['spec']['ports'][0]['port']}"
    assert (ex.namespace, ex.image) == (NS, ctl["image"])
    # its service account is the one the executor's Role is bound to; nothing cluster-wide by default
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == sa and pod["automountServiceAccountToken"] is True
    assert one(docs, "RoleBinding")["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NS}]
    assert not [d for d in docs if d["kind"].startswith("Cluster")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_service_monitor_scrapes_metrics_with_the_token():
    assert not [d for d in render("defaults") if d["kind"] == "ServiceMonitor"]  # off by default
    docs = render("service-monitor")
    sm, svc = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    endpoint = sm["spec"]["endpoints"][0]
    assert endpoint["port"] == svc["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": one(docs, "Secret")["metadata"]["name"], "key": "token"}


def test_executor_and_backend_values_reach_the_controller():
    docs = render("executor-backends")
    ctl = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert ctl["image"] == "registry.example/rolloutd:9"
    params = typer.main.get_command(rolloutd_app).commands["controller"].make_context("controller", ctl["args"]).params
    assert params["executors"] == "kubernetes,local"
    env = env_of(ctl)
    assert env["ROLLOUTD_K8S_NAMESPACE"] == "rl-jobs" and env["ROLLOUTD_K8S_NODE_IMAGE"] == "registry.example/node:2"
    assert env["ROLLOUTD_DRAIN_SECONDS"] == "60" and env["ROLLOUTD_TOKENIZER_ROOTS"] == os.pathsep.join(["/models", "/hf"])
    settings = ControllerSettings.from_env(env)  # parsed by the controller's code, as it starts
    assert [str(n) for n in settings.backend_allow_nets] == ["169.254.0.0/16", "fd00::/8"]
    assert (settings.k8s_namespace, settings.k8s_node_image, settings.drain_seconds) == \
        ("rl-jobs", "registry.example/node:2", 60.0)
    assert {"name": "datasets", "mountPath": "/datasets", "readOnly": True} in ctl["volumeMounts"]
    assert {r["metadata"]["namespace"] for r in docs if r["kind"] in ("Role", "RoleBinding")} == {"rl-jobs", "rl-b"}
    pvc = one(docs, "PersistentVolumeClaim")["spec"]
    assert (pvc["storageClassName"], pvc["resources"]["requests"]["storage"]) == ("fast", "50Gi")


def test_operator_mode_gets_its_cluster_role(tmp_path, monkeypatch):
    docs = render("operator")
    dep = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert dep["command"] == ["rolloutd", "operator"]
    # the operator's own CLI takes the arguments; with no --kubeconfig, in a pod, the service account's cluster
    params = typer.main.get_command(rolloutd_app).commands["operator"].make_context("operator", dep["args"]).params
    assert params["kubeconfig"] is None and params["executors"] == "kubernetes"
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("sa-token\n")
    conn = Connection.in_cluster(account, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert (conn.server, conn.token, conn.ca_path) == ("https://10.96.0.1:443", "sa-token", str(account / "ca.crt"))
    with pytest.raises(ValueError, match="give --kubeconfig"):
        Connection.in_cluster(account, {})
    rules = one(docs, "ClusterRole")["rules"]
    assert {"apiGroups": ["rolloutd.io"], "resources": ["rolloutjobs/status"], "verbs": ["get", "patch", "update"]} in rules
    # the kubernetes executor creates its Jobs in each RolloutJob's namespace: granted cluster-wide, no Role
    executor = [r for r in rules if r["apiGroups"] in (["batch"], [""]) and r["resources"] != ["events"]
                and r["resources"] != ["namespaces"]]
    controller_role = one(render("defaults"), "Role")["rules"]
    assert executor == controller_role and not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    binding = one(docs, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == one(docs, "ServiceAccount")["metadata"]["name"]


def test_an_external_postgresql_url_comes_from_its_secret():
    ctl = one(render("defaults"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "ROLLOUTD_STORE" not in {e["name"] for e in ctl["env"]}  # SQLite on the volume by default
    ctl = one(render("postgresql"), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    [store] = [e for e in ctl["env"] if e["name"] == "ROLLOUTD_STORE"]
    assert store["valueFrom"] == {"secretKeyRef": {"name": "rolloutd-db", "key": "uri"}}
    url = "postgresql://rolloutd:pw@db.rl.svc:5432/rolloutd"  # what the controller reads from it as it starts
    assert ControllerSettings.from_env({"ROLLOUTD_STORE": url}).store == url


def test_replicas_elect_a_leader_on_postgresql_and_sqlite_keeps_one():
    dep = one(render("replicas"), "Deployment")
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ROLLOUTD_REPLICAS"]["value"] == f"http://r-rolloutd.{NS}.svc:7350"  # the daemons' other address
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["ROLLOUTD_ADVERTISE_URL"]["value"] == "http://$(POD_IP):7350"  # where followers forward to
    assert ControllerSettings.from_env({"ROLLOUTD_REPLICAS": "http://a:1,http://b:1"}).replicas == "http://a:1,http://b:1"
    out = subprocess.run([helm(), "template", "r", str(CHART), "-f", "-"], capture_output=True, text=True,
                         input=yaml.safe_dump({"controller": {"replicas": 2}}))
    assert out.returncode != 0 and "needs the PostgreSQL store" in out.stderr
    assert one(render("defaults"), "Deployment")["spec"]["replicas"] == 1


def test_bring_your_own_secret_and_volume():
    docs = render("bring-your-own")
    assert not [d for d in docs if d["kind"] in ("Secret", "PersistentVolumeClaim", "ServiceAccount", "Role")]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["tokens"]["secret"]["secretName"] == "my-tokens"
    assert {v["name"]: v for v in pod["volumes"]}["data"]["persistentVolumeClaim"]["claimName"] == "my-pvc"
    assert pod["serviceAccountName"] == "builder"
    assert pod["automountServiceAccountToken"] is False  # the local executor needs no Kubernetes API


def test_given_tokens_are_used_and_bad_values_are_refused():
    out = subprocess.run([helm(), "template", "r", str(CHART), "--set", "auth.token=abc", "--set", "auth.joinToken=xyz"],
                         capture_output=True, text=True, check=True).stdout
    secret = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Secret")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {"token": "abc"}  # joinToken: ignored
    for flag, message in (("mode=serverless", "at '/mode': value must be one of 'controller', 'operator'"),
                          ("serviceMonitor.enable=true", "at '/serviceMonitor': additional properties 'enable' not allowed"),
                          ("executor.kinds={kubernetes,k8s}", "at '/executor/kinds/1': value must be one of")):
        bad = subprocess.run([helm(), "template", "r", str(CHART), "--set", flag], capture_output=True, text=True)
        assert bad.returncode != 0 and message in bad.stderr, (flag, bad.stderr)


def test_notes_tell_how_to_reach_the_api():
    out = subprocess.run([helm(), "install", "r", str(CHART), "-n", NS, "--dry-run=client"],
                         capture_output=True, text=True, env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NS} port-forward svc/r-rolloutd 7350:7350" in notes
    assert f"kubectl -n {NS} get secret r-rolloutd-tokens -o jsonpath='{{.data.token}}' | base64 -d" in notes
    assert "ROLLOUTD_SERVER=http://127.0.0.1:7350" in notes


def test_the_default_image_is_the_one_make_image_builds():
    """`make image` (charts/image/build.py) tags rolloutd:<the project's version>; the chart runs that by default,
    in the controller, its init container and the kubernetes executor's node pods (tests/image runs the image)."""
    import tomllib

    version = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == version
    pod = one(render("defaults"), "Deployment")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert images == {f"rolloutd:{version}"} and env["ROLLOUTD_K8S_NODE_IMAGE"] == f"rolloutd:{version}"
    assert pod["securityContext"]["runAsUser"] == 1000  # the image's user (charts/image/Containerfile)
    import importlib.util

    spec = importlib.util.spec_from_file_location("image_build", CHART.parent / "image" / "build.py")
    image_build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(image_build)
    assert image_build.DEFAULT_TAG == f"rolloutd:{version}"
