"""swe handler: the shipped minilib instances, EVAL replaying the agent's diff in a FRESH real bwrap
sandbox (reward 1 for the gold fix, 0 without it or when a PASS_TO_PASS test breaks), staging
without history, and the example's build staying in sync with its committed output."""
import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from rolloutd.agents.tasks import DatasetError, EvalError
from rolloutd.agents.tasks.swe import SweTask, parse_test_log, patch_paths
from rolloutd.agents.tasks.swe_repo import stage_repo
from rolloutd.crds.trajectory import Trajectory
from rolloutd.sandbox.protocol import FileContent

ROOT = Path(__file__).resolve().parents[3]
DATASET = ROOT / "examples" / "swe" / "train.jsonl"


def _traj():
    return Trajectory(job="j", prompt=0, sample=0)


@pytest.fixture(scope="module")
def rows():
    return SweTask().load(DATASET)


def rollout(sandboxes, row, agent, **handler_options):
    """INIT a RUN sandbox, let `agent(sb)` act in it, EVAL with fresh sandboxes from the fixture."""
    async def main():
        handler = SweTask(sandbox_factory=sandboxes.create, **handler_options)
        sb = await sandboxes.create()
        try:
            await handler.init(row, sb)
            await agent(sb)
            return await handler.eval(row, sb, _traj())
        finally:
            await sb.close()
    return asyncio.run(main())


def apply_gold(row):
    async def agent(sb):
        await sb.write_file("gold.diff", row["patch"])   # outside the repo: not part of the diff
        r = await sb.bash("cd /workspace/repo && git apply /workspace/gold.diff")
        assert r.exit_code == 0, r.output
    return agent


async def idle(sb):
    pass


def test_every_instance_gold_fix_scores_1_and_no_fix_scores_0(sandboxes, rows):
    assert len(rows) >= 3

    async def main():
        async def one(row, agent):
            handler = SweTask(sandbox_factory=sandboxes.create)
            sb = await sandboxes.create()
            try:
                await handler.init(row, sb)
                await agent(sb)
                return await handler.eval(row, sb, _traj())
            finally:
                await sb.close()
        return await asyncio.gather(*(one(r, a) for r in rows for a in (apply_gold(r), idle)))

    results = asyncio.run(main())
    for i, row in enumerate(rows):
        good, bad = results[2 * i], results[2 * i + 1]
        assert good.value == 1.0, (row["instance_id"], good.details)
        assert set(good.details["fail_to_pass"].values()) == {"PASSED"} and good.details["pass_to_pass_broken"] == []
        assert good.details["patch"].startswith("diff --git")
        assert bad.value == 0.0, (row["instance_id"], bad.details)
        assert bad.details["patch"] == "" and set(bad.details["fail_to_pass"].values()) == {"FAILED"}


def test_breaking_a_pass_to_pass_test_scores_0(sandboxes, rows):
    row = rows[0]                       # median fix ...

    async def agent(sb):
        await apply_gold(row)(sb)
        await sb.bash("cd /workspace/repo && sed -i 's/return max(low, min(value, high))/return value/' minilib/stats.py")

    reward = rollout(sandboxes, row, agent)   # ... plus a broken clamp()
    assert reward.value == 0.0
    assert reward.details["fail_to_pass"] == {row["FAIL_TO_PASS"][0]: "PASSED"}
    assert "tests/test_stats.py::test_clamp_below_and_above" in reward.details["pass_to_pass_broken"]


def test_editing_the_tests_does_not_help(sandboxes, rows):
    row = rows[0]
    test_file = row["FAIL_TO_PASS"][0].split("::")[0]
    name = row["FAIL_TO_PASS"][0].split("::")[1]

    async def agent(sb):   # no fix; instead adds a trivially passing test of the same name
        await sb.bash(f"cd /workspace/repo && printf '\\n\\ndef {name}():\\n    pass\\n' >> {test_file}")

    reward = rollout(sandboxes, row, agent)
    assert reward.value == 0.0 and reward.details["fail_to_pass"][row["FAIL_TO_PASS"][0]] == "FAILED"


def test_broken_repository_and_unappliable_work_score_0(sandboxes, rows):
    async def delete_git(sb):
        await sb.bash("rm -rf /workspace/repo/.git")

    reward = rollout(sandboxes, rows[0], delete_git)
    assert reward.value == 0.0 and reward.details["reason"].startswith("cannot take the diff")


def test_init_stages_base_without_history(sandboxes, rows):
    row = rows[1]

    async def main():
        sb = await sandboxes.create()
        try:
            await SweTask().init(row, sb)
            log = await sb.bash("cd /workspace/repo && git log --oneline | wc -l && git status --porcelain | wc -l")
            return (log.output.split(), await sb.read_file("repo/minilib/sequences.py"),
                    await sb.read_file("repo/tests/test_sequences.py"))
        finally:
            await sb.close()

    (commits, dirty), code, tests = asyncio.run(main())
    assert commits == "1" and dirty == "0"          # one commit: the fix is not in any history
    assert "len(items) - size + 1" in code          # the injected bug is there
    assert "def test_chunk_keeps_remainder" not in tests   # its test arrives only with test_patch


def test_stage_repo_is_deterministic(tmp_path, rows):
    row = rows[2]
    a = stage_repo(row["repo_path"], row["base_commit"], tmp_path / "a")
    b = stage_repo(row["repo_path"], row["base_commit"], tmp_path / "b")
    assert a == b
    with pytest.raises(EvalError, match="not empty"):
        stage_repo(row["repo_path"], row["base_commit"], tmp_path / "a")


def test_fresh_sandbox_from_the_run_sandboxs_spec(sandboxes, rows):
    """No factory given: EVAL makes its fresh sandbox from the RUN sandbox's own spec."""
    row = rows[2]

    async def main():
        handler = SweTask()
        sb = await sandboxes.create()
        try:
            await handler.init(row, sb)
            await apply_gold(row)(sb)
            return await handler.eval(row, sb, _traj())
        finally:
            await sb.close()

    assert asyncio.run(main()).value == 1.0


def test_without_a_way_to_make_sandboxes_eval_is_an_infra_error(rows):
    class Bare:   # a RUN sandbox with no spec, and no factory given
        workspace = Path("/nonexistent")

        async def bash(self, command, **kw):
            return type("R", (), {"exit_code": 0, "timed_out": False, "output": ""})()

        async def read_file(self, path, **kw):
            return ""

        async def read_file_info(self, path, **kw):
            return FileContent(content="", total_lines=0)

    with pytest.raises(EvalError, match="needs a fresh sandbox"):
        asyncio.run(SweTask().eval(rows[0], Bare(), _traj()))


def test_dataset_fields(tmp_path, rows):
    row = dict(rows[0])
    assert Path(row["repo_path"]).is_absolute() and Path(row["repo_path"]).exists()
    p = tmp_path / "swe.jsonl"
    row["repo_path"] = str(DATASET.parent / "minilib.git.tar.gz")
    row["FAIL_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"])     # SWE-bench's JSON-in-a-string form
    p.write_text(json.dumps(row) + "\n")
    assert SweTask().load(p)[0]["FAIL_TO_PASS"] == rows[0]["FAIL_TO_PASS"]
    del row["test_command"]
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=r"swe\.jsonl:1: missing field 'test_command'"):
        SweTask().load(p)
    row["test_command"], row["repo_path"] = "pytest", "nowhere.tar.gz"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=r"swe\.jsonl:1: field 'repo_path': .*nowhere\.tar\.gz does not exist"):
        SweTask().load(p)
    row["repo_path"] = str(DATASET.parent / "minilib.git.tar.gz")
    for timeout in ("300", -1, 0, 10**9):  # unchecked before: a string failed EVAL as infra, -1 scored 0 as timed out
        p.write_text(json.dumps({**row, "timeout": timeout}) + "\n")
        with pytest.raises(DatasetError, match=r"swe\.jsonl:1: field 'timeout' must be a positive number of seconds"):
            SweTask().load(p)


def test_helpers():
    assert patch_paths("diff --git a/t/x.py b/t/x.py\n--- a/t/x.py\n+++ b/t/x.py\n"
                       "diff --git a/old.py b/new.py\n") == ["t/x.py", "old.py", "new.py"]
    log = "PASSED tests/a.py::test_1\nFAILED tests/a.py::test_2 - assert 1 == 2\nERROR tests/b.py::test_3\n"
    assert parse_test_log(log) == {"tests/a.py::test_1": "PASSED", "tests/a.py::test_2": "FAILED",
                                   "tests/b.py::test_3": "ERROR"}


def test_committed_example_matches_its_build(tmp_path):
    """examples/swe/train.jsonl is what examples/swe/build.py produces (rebuild after editing minilib/)."""
    spec = importlib.util.spec_from_file_location("swe_example_build", ROOT / "examples/swe/build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    rebuilt = build.build(tmp_path, verify=False)   # the eval tests above check the instances
    committed = [json.loads(line) for line in DATASET.read_text().splitlines() if line.strip()]
    assert rebuilt == committed, "stale examples/swe/train.jsonl: run `python examples/swe/build.py`"
