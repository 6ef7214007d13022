"""code handler: hidden pytest tests run against the agent's solution.py in a REAL bwrap sandbox."""
import asyncio
import json
import sys
import types

import pytest

from rolloutd.agents.tasks import DatasetError, EvalError
from rolloutd.agents.tasks.base import stash_answer
from rolloutd.agents.tasks.code import CodeTask, parse_junit
from rolloutd.crds.trajectory import Trajectory

TASK = {
    "id": "add",
    "prompt": "Write add(a, b).",
    "tests": "from solution import add\n\n\ndef test_one():\n    assert add(2, 3) == 5\n\n\n"
             "def test_two():\n    assert add(-4, 1) == -3\n\n\ndef test_three():\n    assert add(0, 0) == 0\n",
}
GOOD = "def add(a, b):\n    return a + b\n"
PARTIAL = "def add(a, b):\n    return abs(a + b)\n"     # passes 2 of 3


def _traj(final_text=""):
    return stash_answer(Trajectory(job="j", prompt=0, sample=0), submitted=None, final_text=final_text)


def run(coro_fn, sandboxes):
    async def main():
        sb = await sandboxes.create()
        try:
            return await coro_fn(sb)
        finally:
            await sb.close()
    return asyncio.run(main())


def test_known_good_and_bad_solution_files(sandboxes):
    async def body(sb):
        await sb.write_file("solution.py", GOOD)
        good = await CodeTask().eval(TASK, sb, _traj())
        await sb.write_file("solution.py", "def add(a, b):\n    return None\n")
        bad = await CodeTask().eval(TASK, sb, _traj())
        await sb.write_file("solution.py", PARTIAL)
        fraction = await CodeTask().eval(TASK, sb, _traj())
        all_or_nothing = await CodeTask(reward="all").eval(TASK, sb, _traj())
        return good, bad, fraction, all_or_nothing

    good, bad, fraction, all_or_nothing = run(body, sandboxes)
    assert good.value == 1.0 and good.details["passed"] == good.details["total"] == 3
    assert good.details["source"] == "/workspace/solution.py"
    assert bad.value == 0.0 and bad.details["passed"] == 0 and "assert" in bad.details["log"]
    assert fraction.value == pytest.approx(2 / 3)
    assert all_or_nothing.value == 0.0 and all_or_nothing.details["passed"] == 2


def test_solution_from_the_answers_code_block(sandboxes):
    async def body(sb):
        good = await CodeTask().eval(TASK, sb, _traj(f"Here:\n```python\n{GOOD}```\nDone."))
        none = await CodeTask().eval(TASK, sb, _traj("I could not do it."))
        syntax = await CodeTask().eval(TASK, sb, _traj("```python\ndef add(a, b) return\n```"))
        return good, none, syntax

    good, none, syntax = run(body, sandboxes)
    assert good.value == 1.0 and good.details["source"] == "code block"
    assert none.value == 0.0 and none.details["reason"] == "no solution.py and no code block"
    assert syntax.value == 0.0 and syntax.details["total"] == 3 and "SyntaxError" in syntax.details["log"]


def test_agent_planted_conftest_and_ini_are_ignored(sandboxes):
    async def body(sb):
        await sb.write_file("solution.py", "def add(a, b):\n    return 0\n")
        # a conftest.py / pytest.ini in the workspace that would turn every failure into a pass
        await sb.write_file("conftest.py", "import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
                                           "def pytest_runtest_makereport(item, call):\n"
                                           "    out = yield\n    out.get_result().outcome = 'passed'\n")
        await sb.write_file("pytest.ini", "[pytest]\naddopts = -p no:junitxml\n")
        return await CodeTask().eval(TASK, sb, _traj())

    reward = run(body, sandboxes)
    assert reward.value == pytest.approx(1 / 3) and reward.details["passed"] == 1


def test_hard_exit_and_timeout_score_zero(sandboxes):
    async def body(sb):
        await sb.write_file("solution.py", "import os\nos._exit(0)\n")
        exited = await CodeTask().eval(TASK, sb, _traj())
        await sb.write_file("solution.py", "while True:\n    pass\n")
        hung = await CodeTask(timeout=2).eval(TASK, sb, _traj())
        return exited, hung

    exited, hung = run(body, sandboxes)
    assert exited.value == 0.0 and exited.details["reason"] == "no test report"
    assert hung.value == 0.0 and "timed out" in hung.details["reason"]


def test_interpreter_missing_is_an_infra_error(sandboxes):
    async def body(sb):
        await sb.write_file("solution.py", GOOD)
        return await CodeTask(python="/nonexistent/python").eval(TASK, sb, _traj())

    with pytest.raises(EvalError, match="cannot run"):
        run(body, sandboxes)


def test_eval_without_sandbox_is_an_infra_error():
    with pytest.raises(EvalError):
        asyncio.run(CodeTask().eval(TASK, None, _traj()))


def test_shipped_dataset(sandboxes):
    rows = CodeTask().load("examples/code/train.jsonl")
    assert len(rows) >= 10
    for row in rows:   # every reference solution passes its tests (in-process: our own data, fast)
        module = types.ModuleType("solution")
        exec(row["canonical_solution"], module.__dict__)
        sys.modules["solution"] = module
        try:
            namespace = {}
            exec(row["tests"], namespace)
            for name, fn in namespace.items():
                if name.startswith("test_"):
                    fn()
        finally:
            del sys.modules["solution"]

    async def body(sb):   # and a few through the handler in the sandbox
        rewards = []
        for row in rows[:3]:
            await sb.write_file("solution.py", row["canonical_solution"])
            rewards.append((await CodeTask().eval(row, sb, _traj())).value)
        await sb.write_file("solution.py", "")
        rewards.append((await CodeTask().eval(rows[0], sb, _traj())).value)
        return rewards

    assert run(body, sandboxes) == [1.0, 1.0, 1.0, 0.0]


def test_dataset_validation(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"id": 1, "prompt": "p", "tests": "def helper():\n    pass\n"}) + "\n")
    with pytest.raises(DatasetError, match=r"c\.jsonl:1: field 'tests' defines no test_\* function"):
        CodeTask().load(p)
    p.write_text(json.dumps({"id": 1, "prompt": "p", "tests": "def test_x(:\n"}) + "\n")
    with pytest.raises(DatasetError, match=r"c\.jsonl:1: field 'tests' is not valid Python"):
        CodeTask().load(p)
    good = {"id": 1, "prompt": "p", "tests": "def test_x():\n    pass\n"}
    for timeout in ("60", True, 0, -1, 10**9):  # a string failed EVAL at every attempt; 0 or less scored 0
        p.write_text(json.dumps({**good, "timeout": timeout}) + "\n")
        with pytest.raises(DatasetError, match=r"c\.jsonl:1: field 'timeout' must be a positive number of seconds"):
            CodeTask().load(p)
    p.write_text(json.dumps({**good, "timeout": 7 * 86400}) + "\n")
    assert CodeTask().load(p)[0]["timeout"] == 7 * 86400
    with pytest.raises(ValueError, match="reward must be"):
        CodeTask(reward="half")


def test_messages_say_where_the_solution_goes():
    with_tools = CodeTask().messages(TASK, ["bash"])[1]["content"]
    without = CodeTask().messages(TASK, [])[1]["content"]
    assert "/workspace/solution.py" in with_tools and "```python" in without


def test_parse_junit():
    xml = ('<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure/></testcase>'
           '<testcase name="c"><skipped/></testcase><testcase name="d"><error/></testcase></testsuite></testsuites>')
    assert parse_junit(xml) == (1, 4)


# Left running by the agent: waits for EVAL's directory, then keeps writing a JUnit report of all passes.
FAKE_REPORT = ('<testsuites><testsuite name="pytest" tests="3">' + '<testcase name="t{}"/>' * 3 + '</testsuite></testsuites>'
               ).format(1, 2, 3)
FORGER = f"""while true; do for d in /workspace/.rolloutd-eval-*; do
  [ -d "$d" ] && echo '{FAKE_REPORT}' > "$d/junit.xml" 2>/dev/null; done; sleep 0.005; done
"""


def test_a_process_the_agent_left_cannot_forge_the_test_report(sandboxes):
    """The tests run in the agent's sandbox: every process the agent left is ended before EVAL, so one
    cannot rewrite the JUnit report the reward is read from (with it running, a wrong answer scored 1)."""
    async def body(sb):
        await sb.write_file("solution.py", "def add(a, b):\n    return None\n")
        await sb.write_file("forger.sh", FORGER)
        await sb.bash("nohup bash forger.sh > /dev/null 2>&1 &", session="agent")
        reward = await CodeTask().eval(TASK, sb, _traj())
        left = await sb.bash("pgrep -fc forger.sh || true")
        return reward, left.output.strip()

    reward, left = run(body, sandboxes)
    assert reward.value == 0.0 and reward.details["passed"] == 0 and reward.details["total"] == 3
    assert reward.details["agent_processes_ended"] is True and left == "0"
