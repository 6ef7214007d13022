"""Issue 24, item 2: the node and the controller read a tenant's data beneath its policy's data roots, never as
root, never through a link out, and no error text carries a byte of a file.

Plays team-a against the real reader (rolloutd.crds.kit.safe_read), the real task handlers and the real scheduler's
dataset expansion (a Store in SQLite, leases as a node takes them): another namespace's 0600 dataset, symlinks to
/etc/shadow, to a secret and to /proc, `..`, a hard link, a FIFO, Harbor task files that are links to a secret,
malformed rows with secret-looking payloads. Both resolvers run: openat2(2) and the O_NOFOLLOW walk kept for
kernels without it. The data lives under a fresh world-searchable directory in /tmp (the reader reads as nobody).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from rolloutd.agents.tasks import DatasetError, HandlerScope, get_handler
from rolloutd.agents.tasks.base import ConfigError
from rolloutd.agents.tasks.harbor import stage_dir
from rolloutd.controller.store import Store
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.kit import safe_read
from rolloutd.crds.node import NODE_PROTOCOL, RegisterRequest
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.tenancy import TenantPolicySpec
from rolloutd.sandbox import SandboxSpec, get_runtime

REPO = Path(__file__).resolve().parents[2]
HARBOR_TASK = REPO / "examples" / "harbor" / "tasks" / "word-count"
EXAMPLE = REPO / "examples" / "math-demo.yaml"
# fixed, not drawn per run: test ids carry it, and every pytest-xdist worker must collect the same ids
SECRET = "TOPSECRET-7c1e4f9a02b85d36"
DUPLICATE = json.dumps({"id": SECRET, "question": "q", "answer": "2"})


def _row(i: int, answer: str = "2") -> str:
    return json.dumps({"id": f"q{i}", "question": "1+1?", "answer": answer}) + "\n"


@pytest.fixture(params=["openat2", "walk"])
def area(request, monkeypatch):
    """/tmp/…/{team-a, team-b, outside}: team-a's root holds a good dataset; team-b's holds a root-owned 0600 one
    full of secrets; `outside` a world-readable secret. Every test runs with both resolvers."""
    if request.param == "walk":
        monkeypatch.setattr(safe_read, "_have_openat2", False)
    base = Path(tempfile.mkdtemp(prefix="rolloutd-data-", dir="/tmp"))
    base.chmod(0o755)
    for name in ("team-a", "team-b", "outside"):
        (base / name).mkdir(mode=0o755)
        (base / name).chmod(0o755)
    good = base / "team-a" / "train.jsonl"
    good.write_text(_row(0) + _row(1))
    good.chmod(0o644)
    private = base / "team-b" / "private.jsonl"
    private.write_text(_row(0, SECRET))
    private.chmod(0o600)
    secret = base / "outside" / "secret.jsonl"
    secret.write_text(_row(0, SECRET))
    secret.chmod(0o644)
    yield base
    shutil.rmtree(base, ignore_errors=True)
    if request.param == "openat2":
        assert safe_read._have_openat2 is not False, "the kernel refused openat2: the walk was tested twice"


def _refused(load, *, match: str = "") -> str:
    with pytest.raises(DatasetError) as info:
        load()
    text = str(info.value)
    assert SECRET not in text and "root:" not in text, text
    assert text.startswith("spec.tasks.source: ") or ".jsonl:" in text or ": task " in text, text
    assert match in text, text
    return text


# ---------------------------------------------------------------------- the real scheduler's expansion
def _scheduler(tmp_path: Path, source: str, roots: list[str] | None, kind: str = "math"):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["tasks"] = {"kind": kind, "source": source}
    doc["spec"]["samplesPerPrompt"] = 1
    doc["spec"]["executor"]["nodes"] = 1  # one node takes every lease
    store = Store(tmp_path / "db.sqlite")
    store.apply(RolloutJob.model_validate(doc))
    sched = Scheduler(build_work(store))
    sched.work.expansions.policy_for = lambda job: None if roots is None else TenantPolicySpec(data_roots=roots)
    job = store.get("math-demo")
    row = sched.work.expansions.expand(job)
    node = sched.work.registry.register(RegisterRequest(job="math-demo", protocol=NODE_PROTOCOL, name="n1")).node_id
    leases = asyncio.run(sched.work.attempts.lease(node, 100)).leases
    return row, leases


@pytest.mark.parametrize("roots, why", [
    (["team-a"], "not beneath a data root"),
    ([""], "not readable by an unprivileged user"),  # a root both teams share: the read is nobody's, not root's
])
def test_another_namespaces_dataset_never_reaches_team_as_leases(area, tmp_path, roots, why):
    if os.geteuid() != 0 and why.startswith("not readable"):
        pytest.skip("a root-owned 0600 file needs a root controller to make the point")
    roots = [str(area / r) if r else str(area) for r in roots]
    row, leases = _scheduler(tmp_path, str(area / "team-b" / "private.jsonl"), roots)
    assert leases == [] and row.prompts == 0
    assert row.error.startswith("DatasetError: spec.tasks.source: ") and why in row.error and SECRET not in row.error


def test_the_tenants_own_dataset_is_expanded_and_leased(area, tmp_path):
    row, leases = _scheduler(tmp_path, str(area / "team-a" / "train.jsonl"), [str(area / "team-a")])
    assert row.error == "" and len(leases) == 2


def test_a_harbor_task_linking_to_a_secret_is_refused_and_never_leased(area, tmp_path):
    tasks = area / "team-a" / "tasks"
    shutil.copytree(HARBOR_TASK, tasks / "t1")
    for path in [tasks, *tasks.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (tasks / "t1" / "instruction.md").unlink()
    (tasks / "t1" / "instruction.md").symlink_to(area / "outside" / "secret.jsonl")
    row, leases = _scheduler(tmp_path, str(tasks), [str(area / "team-a")], kind="harbor")
    assert leases == [] and "leads out of the data root" in row.error and SECRET not in row.error


# ---------------------------------------------------------------------- every attack through the real handlers
@pytest.mark.parametrize("plant, why", [
    (lambda a, d: d.symlink_to("/etc/shadow"), "leads out of the data root"),
    (lambda a, d: d.symlink_to(a / "outside" / "secret.jsonl"), "leads out of the data root"),
    (lambda a, d: d.symlink_to("../outside/secret.jsonl"), "leads out of the data root"),
    (lambda a, d: d.symlink_to("/proc/self/environ"), "leads out of the data root"),
    (lambda a, d: d.symlink_to(f"/proc/self/root{a}/outside/secret.jsonl"), "leads out of the data root"),
    (lambda a, d: os.link(a / "outside" / "secret.jsonl", d), "is a hard link"),
    (lambda a, d: os.mkfifo(d, 0o666), "is not a regular file"),
])
@pytest.mark.parametrize("kind", ["math", "stem", "code", "swe"])
def test_links_out_hard_links_and_fifos_are_refused(area, plant, why, kind):
    data = area / "team-a" / "data.jsonl"
    plant(area, data)
    _refused(lambda: get_handler(kind).load(str(data), roots=[str(area / "team-a")]), match=why)


@pytest.mark.parametrize("source, why", [
    ("{a}/team-a/../team-b/private.jsonl", "without '..'"),
    ("{a}/team-b/private.jsonl", "not beneath a data root"),
    ("/proc/self/root{a}/team-a/train.jsonl", "not beneath a data root"),
    ("/proc/self/environ", "not beneath a data root"),
    ("/etc/shadow", "not beneath a data root"),
    ("train.jsonl", "absolute path"),
])
def test_paths_outside_the_roots_are_refused(area, source, why):
    _refused(lambda: get_handler("math").load(source.format(a=area), roots=[str(area / "team-a")]), match=why)


def test_with_the_whole_host_as_root_proc_and_root_only_files_stay_closed(area):
    """Even an admin-granted root of "/" gives no magic link and no root's read: /proc/self/root is a magic link,
    /proc/self/environ and /etc/shadow are not nobody's to read."""
    for source, why in ((f"/proc/self/root{area}/team-a/train.jsonl", "goes through a link that is not allowed"
                         if safe_read._have_openat2 is not False else "leads out of the data root"),
                        ("/proc/self/environ", "not readable by an unprivileged user"),
                        ("/etc/shadow", "not readable by an unprivileged user")):
        _refused(lambda: get_handler("math").load(source, roots=["/"]), match=why)


def test_a_link_that_stays_beneath_the_root_is_followed(area):
    root = area / "team-a"
    (root / "sub").mkdir(mode=0o755)
    (root / "sub" / "data.jsonl").symlink_to("../train.jsonl")
    (root / "latest").symlink_to("sub")
    assert len(get_handler("math").load(str(root / "latest" / "data.jsonl"), roots=[str(root)])) == 2


def test_the_admins_job_reads_as_before_but_through_no_magic_link(tmp_path):
    data = tmp_path / "d.jsonl"  # under pytest's 0700 directory: nobody could not read it, the admin's job can
    data.write_text(_row(0))
    data.chmod(0o600)
    assert len(get_handler("math").load(data)) == 1
    assert safe_read._have_openat2, "this kernel has openat2 (5.6+): the magic-link refusal below needs it"
    with pytest.raises(DatasetError, match="goes through a link that is not allowed"):
        get_handler("math").load(f"/proc/self/root{data}")


# ---------------------------------------------------------------------- error texts
@pytest.mark.parametrize("kind, line, says", [
    ("math", '{"id": "a", "question": "q", "answer": "' + SECRET, "data.jsonl:2: not valid JSON"),
    ("stem", json.dumps({"id": "a", "question": "q", "choices": ["x", "y"], "answer": SECRET}),
     "data.jsonl:2: field 'answer' must be one of A, B"),
    ("math", f"{DUPLICATE}\n{DUPLICATE}", "data.jsonl:3: field 'id': duplicate id (first on line 2)"),
    ("swe", json.dumps({"instance_id": "a", "problem_statement": "p", "base_commit": SECRET, "FAIL_TO_PASS": ["t"],
                        "PASS_TO_PASS": [], "test_patch": "", "repo_path": ".", "test_command": "x"}),
     "data.jsonl:2: field 'base_commit' must be a commit id"),
])
def test_a_malformed_row_names_line_and_field_never_content(area, kind, line, says):
    data = area / "team-a" / "data.jsonl"
    first = {"math": _row(0), "swe": ""}.get(kind, json.dumps({"id": "q0", "question": "q", "choices": ["x", "y"],
                                                                "answer": "A"}) + "\n")
    data.write_text((first or "\n") + line + "\n")
    data.chmod(0o644)
    _refused(lambda: get_handler(kind).load(str(data), roots=[str(area / "team-a")]), match=says)


def test_bytes_that_are_not_utf8_are_not_echoed(area):
    data = area / "team-a" / "data.jsonl"
    data.write_bytes(_row(0).encode() + b'{"id": "\xff' + SECRET.encode() + b'"}\n')
    data.chmod(0o644)
    _refused(lambda: get_handler("math").load(str(data), roots=[str(area / "team-a")]), match="data.jsonl:2: not UTF-8")


@pytest.mark.parametrize("name, link, toml, says", [
    ("instruction.md", True, None, "instruction.md: leads out of the data root"),
    ("task.toml", True, None, "task.toml: leads out of the data root"),
    ("task.toml", False, f'[agent]\nuser = "root:$6${SECRET}"\n', "task.toml agent.user must be"),
    ("task.toml", False, f'[agent]\ntimeout_sec = "{SECRET}"\n', "task.toml agent.timeout_sec must be"),
    ("task.toml", False, f'password = {SECRET}\n', "task.toml: not valid TOML (at line 1, column 12)"),
    ("task.toml", False, f'{SECRET} = 1\n{SECRET} = 2\n', "task.toml: not valid TOML (at line 2"),
    ("environment/Dockerfile", False, f'FROM python:3.12-slim\nARG -{SECRET}\n', "Dockerfile:2: ARG name '…' is not"),
])
def test_harbor_task_files_that_link_out_or_do_not_parse_leak_nothing(area, name, link, toml, says):
    tasks = area / "team-a" / "tasks"
    shutil.copytree(HARBOR_TASK, tasks / "t1")
    for path in [tasks, *tasks.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    target = tasks / "t1" / name
    target.unlink(missing_ok=True)
    if link:
        target.symlink_to(area / "outside" / "secret.jsonl")
    else:
        target.write_text(toml)
        target.chmod(0o644)
    _refused(lambda: get_handler("harbor").load(str(tasks), roots=[str(area / "team-a")]), match=says)


# ---------------------------------------------------------------------- the node's staging of a task's files
def test_the_node_stages_no_file_from_outside_the_root(area):
    """tests/ that is a link out, or holds a hard link to a secret, is refused before anything reaches the
    sandbox (a real bwrap one); a link inside tests/ is staged as a link, never followed on the host."""
    tests = area / "team-a" / "t1" / "tests"
    tests.mkdir(parents=True, mode=0o755)
    (tests.parent).chmod(0o755)
    (tests / "test.sh").write_text("echo ok\n")
    (tests / "test.sh").chmod(0o644)
    (tests / "data").symlink_to("/etc/shadow")  # a link is copied as a link: it names the image's own file
    (area / "team-a" / "t2").symlink_to(area / "outside")
    roots = [str(area / "team-a")]
    spec = SandboxSpec(runtime="bwrap", image="host", network=False)

    async def main():
        runtime = get_runtime("bwrap")
        sandbox = await runtime.create(spec)
        try:
            with pytest.raises(ConfigError, match="leads out of the data root"):
                await stage_dir(sandbox, str(area / "team-a" / "t2"), "/tests", roots)
            os.link(area / "outside" / "secret.jsonl", tests / "leak")
            with pytest.raises(ConfigError, match="is a hard link") as info:
                await stage_dir(sandbox, str(tests), "/tests", roots)
            assert SECRET not in str(info.value)
            listing = [p.name for p in Path(sandbox.workspace).iterdir()]
            os.unlink(tests / "leak")
            entries = safe_read.read_tree(str(tests), roots)
            return listing, entries
        finally:
            await sandbox.close()

    listing, entries = asyncio.run(main())
    assert not any(n.startswith(".rolloutd-stage") for n in listing)
    assert [(e.rel, e.kind, e.target or e.data) for e in entries] == [
        ("data", "link", "/etc/shadow"), ("test.sh", "file", b"echo ok\n")]


# ---------------------------------------------------------------------- swe: the tenant's repository, read by git as nobody
def _git(cwd: Path, *args: str) -> str:
    import subprocess
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_a_swe_repository_borrowing_another_teams_objects_is_not_staged(area, tmp_path):
    """team-a's repository names team-b's private object store as its alternate: git on the node reads as nobody,
    so team-b's tree is not staged; team-a's own repository still is."""
    from rolloutd.agents.tasks.base import EvalError
    from rolloutd.agents.tasks.swe_repo import stage_repo

    if os.geteuid() != 0:
        pytest.skip("the node reads as nobody only when it runs as root")
    theirs, ours = area / "team-b" / "repo", area / "team-a" / "repo"
    for repo in (theirs, ours):
        repo.mkdir()
        _git(repo, "init", "-q", "-b", "main")
        (repo / "file.txt").write_text(SECRET if repo == theirs else "ours\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", "base")
    theirs.chmod(0o700)
    (ours / ".git" / "objects" / "info" / "alternates").write_text(f"{theirs}/.git/objects\n")
    base = _git(theirs, "rev-parse", "HEAD")
    roots = [str(area / "team-a")]
    with pytest.raises(EvalError, match="git archive") as info:
        stage_repo(str(ours), base, tmp_path / "stolen", roots)
    assert SECRET not in str(info.value)
    assert not (tmp_path / "stolen" / "file.txt").exists()
    stage_repo(str(ours), _git(ours, "rev-parse", "HEAD"), tmp_path / "own", roots)
    assert (tmp_path / "own" / "file.txt").read_text() == "ours\n"


def test_the_node_checks_a_harbor_tasks_directory_again(area):
    """A task row naming a directory outside the job's data roots (a job stored before its policy narrowed) is
    refused at INIT, before any image is built from it: a configuration failure, never a rollout."""
    handler = get_handler("harbor")
    handler.bind(HandlerScope(roots=(str(area / "team-a"),)))
    (area / "team-a" / "t1").symlink_to(area / "outside")
    for path in (str(area / "outside"), str(area / "team-a" / "t1")):
        task = {"id": "t1", "path": path}
        with pytest.raises(ConfigError, match=r"^spec\.tasks\.source: .*(not beneath a data root|leads out)"):
            asyncio.run(handler.sandbox_spec(task, SandboxSpec(runtime="bwrap", image="host")))


def test_the_read_is_nobodys_and_the_rest_of_the_process_stays_as_it_was(area):
    """A root-group 0640 file is refused (root's supplementary groups are gone in the reader's thread, not only its
    uid), and the process's other threads keep their identity: this one still reads a root-only 0600 file."""
    if os.geteuid() != 0:
        pytest.skip("the reader changes identity only in a root process")
    group_only = area / "team-a" / "group.jsonl"
    group_only.write_text(_row(0, SECRET))
    group_only.chmod(0o640)
    os.chown(group_only, 0, 4242)
    groups = os.getgroups()
    os.setgroups([*groups, 4242])  # the daemon is in the file's group, as root often is (root, adm, shadow...)
    try:
        _refused(lambda: get_handler("math").load(str(group_only), roots=[str(area / "team-a")]),
                 match="not readable by an unprivileged user")
        assert 4242 in os.getgroups()  # the reader's thread dropped its groups, this thread kept them
    finally:
        os.setgroups(groups)
    before = (os.geteuid(), os.getegid(), sorted(os.getgroups()))
    assert len(get_handler("math").load(str(area / "team-a" / "train.jsonl"), roots=[str(area / "team-a")])) == 2
    assert (os.geteuid(), os.getegid(), sorted(os.getgroups())) == before
    assert SECRET in (area / "team-b" / "private.jsonl").read_text()  # root-only, read by this (root) thread
