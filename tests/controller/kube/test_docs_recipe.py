"""The kubectl recipe of docs/content/kubernetes.md, its lines as written, run with the real kubectl against a real
controller from a HOME whose ~/.kube/config already has the user's own current context: the job is applied,
listed, described and waited for through the named `rolloutd` context, and the user's current context is the
same afterwards (the recipe once ran `kubectl config use-context`, switching the user's default cluster)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from support import kube_tools
from support.example_job import example_yaml
from support.kube_helpers import set_status

DOC = Path(__file__).resolve().parents[3] / "docs" / "content" / "kubernetes.md"
USERS_OWN = {"apiVersion": "v1", "kind": "Config", "current-context": "work",
             "clusters": [{"name": "work", "cluster": {"server": "https://127.0.0.1:1"}}],
             "users": [{"name": "me", "user": {"token": "not-rolloutd"}}],
             "contexts": [{"name": "work", "context": {"cluster": "work", "user": "me"}}]}


def recipe_lines() -> list[str]:
    """The kubectl lines of the page's first bash block (the controller and its certificate are the fixture's)."""
    block = re.search(r"```bash\n(.*?)```", DOC.read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.startswith("kubectl ")]


def user_home(tmp_path: Path, kube) -> tuple[Path, dict[str, str]]:
    """A HOME with the user's own kubeconfig, the controller's token where the page reads it and its certificate
    as the page's cert.pem; the environment kubectl runs in (no KUBECONFIG: ~/.kube/config, as a user's)."""
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(yaml.safe_dump(USERS_OWN))
    (home / ".local" / "share" / "rolloutd").mkdir(parents=True)
    (home / ".local" / "share" / "rolloutd" / "token").write_text(kube.token)
    shutil.copy(kube.cert, tmp_path / "cert.pem")
    (tmp_path / "job.yaml").write_text(example_yaml())  # absolute paths, as the page says kubectl needs
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env.update(HOME=str(home), PATH=f"{Path(kube_tools.kubectl()).parent}{os.pathsep}{env.get('PATH', '')}")
    return home, env


def run(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{line}: {r.stderr}"
    return r


def current_context(env: dict[str, str], cwd: Path) -> str:
    return run("kubectl config current-context", cwd, env).stdout.strip()


def test_the_recipe_reaches_rolloutd_without_switching_the_users_context(kube, tmp_path):
    home, env = user_home(tmp_path, kube)
    assert current_context(env, tmp_path) == "work"
    lines = recipe_lines()
    assert not any("use-context" in line for line in lines)
    out = {}
    for line in lines:
        line = line.replace("https://127.0.0.1:7350", kube.url).replace(" -w ", " ")  # the watch would not end
        if " wait " in line:  # what the operator writes when the job ends (this controller runs no executor)
            set_status(kube.client(), "math-demo", {"phase": "Succeeded", "conditions": [
                {"type": "Complete", "status": "True", "reason": "Done", "message": "done"}]})
        out[line.split("#")[0].strip()] = run(line, tmp_path, env).stdout
    applied = next(v for k, v in out.items() if " apply " in k)
    assert "rolloutjob.rolloutd.io/math-demo created" in applied
    listed = next(v for k, v in out.items() if " get rj" in k)
    assert listed.splitlines()[1].split()[0] == "math-demo"
    assert "math-demo condition met" in next(v for k, v in out.items() if " wait " in k)
    # the user's default is theirs still, and the plain kubectl still talks to their own cluster
    assert current_context(env, tmp_path) == "work"
    config = yaml.safe_load((home / ".kube" / "config").read_text())
    assert {c["name"] for c in config["contexts"]} == {"work", "rolloutd"}
    assert {c["name"]: c["context"] for c in config["contexts"]}["work"] == {"cluster": "work", "user": "me"}


def test_the_separate_kubeconfig_variant_leaves_the_users_file_untouched(kube, tmp_path):
    home, env = user_home(tmp_path, kube)
    before = (home / ".kube" / "config").read_bytes()
    for line in recipe_lines():
        if line.startswith("kubectl config "):
            run(line.split("#")[0].replace("https://127.0.0.1:7350", kube.url).replace(" && ", " ")
                + " --kubeconfig ~/.kube/rolloutd", tmp_path, env)
    listed = run("KUBECONFIG=~/.kube/rolloutd kubectl --context rolloutd get rj", tmp_path, env)
    assert listed.returncode == 0 and "NAME" in listed.stdout
    assert (home / ".kube" / "config").read_bytes() == before
    assert current_context(env, tmp_path) == "work"
