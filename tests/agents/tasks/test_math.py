"""math handler: answer extraction, equivalence, EVAL 1 for a right answer and 0 for a wrong one."""
import asyncio
import os
import time
from pathlib import Path

import pytest

from rolloutd.agents.tasks.base import stash_answer
from rolloutd.agents.tasks.math import MathTask, extract_answer, is_equiv, last_boxed
from rolloutd.crds.trajectory import Trajectory


def _traj(final_text=None, submitted=None, messages=()):
    t = Trajectory(job="j", prompt=0, sample=0, messages=list(messages))
    if final_text is not None or submitted is not None:
        stash_answer(t, submitted=submitted, final_text=final_text)
    return t


@pytest.mark.parametrize("given, expected", [
    ("1/2", "0.5"), ("0.5", "2/4"), ("2/4", "1/2"),
    ("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "1/2"), ("\\tfrac12", "0.5"), ("\\frac12", "2/4"),
    ("-3", "-3.0"), ("-\\frac{3}{4}", "-0.75"), ("−3".replace("−", "-"), "-3"),
    ("1,000", "1000"), ("x = 5", "5"), ("7.", "7"), ("$42$", "42"),
    ("\\sqrt{8}", "2\\sqrt{2}"), ("\\frac{\\sqrt{3}}{2}", "sqrt(3)/2"), ("2^{10}", "1024"),
    ("50\\%", "50"), ("90^\\circ", "90"), ("\\text{5 cm}", "5"), ("\\left(3\\right)", "3"),
    ("2, 3", "3,2"), ("x^2+1", "1+x^2"),
])
def test_equivalent(given, expected):
    assert is_equiv(given, expected)


@pytest.mark.parametrize("given, expected", [
    ("3", "4"), ("0.333", "1/3"), ("-1/2", "1/2"), ("2, 3", "2, 4"), ("", "1"), ("banana", "1"),
])
def test_not_equivalent(given, expected):
    assert not is_equiv(given, expected)


def test_agent_text_never_reaches_eval():
    # sympy parses with eval(); anything outside the arithmetic whitelist is compared as text only
    assert not is_equiv("__import__('os').system('false')", "0")
    assert not is_equiv("(1).__class__", "1")
    assert not is_equiv("9**9**9**9", "1")  # huge powers are refused, not computed


def test_boxed_extraction():
    assert last_boxed("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{1, \\{2\\}\\}}") == "\\{1, \\{2\\}\\}"  # nested braces
    assert last_boxed("first \\boxed{1}, then \\boxed{2}") == "2"  # last boxed wins
    assert last_boxed("\\boxed 5.") == "5"
    assert last_boxed("\\fbox{-7}") == "-7"
    assert last_boxed("no box") is None
    assert last_boxed("broken \\boxed{1 and \\boxed{2}") == "2"


def test_extraction_without_box():
    assert extract_answer("5") == "5"                       # "Answer with just the number."
    assert extract_answer(" -12. ") == "-12"
    assert extract_answer("2 + 3 makes 5 apples") == "5"    # last number
    assert extract_answer("The total is 1,234.") == "1,234"
    assert extract_answer("no number at all") is None
    assert extract_answer("5", require_boxed=True) is None
    assert extract_answer("x \\boxed{-4} y 9") == "-4"      # a box beats later numbers


def _eval(task, traj, **kw):
    return asyncio.run(MathTask(**kw).eval(task, None, traj))


def test_eval_known_good_and_bad():
    task = {"id": "m1", "question": "What is 1/2 + 0?", "answer": "0.5"}
    good = _eval(task, _traj("We get \\boxed{\\dfrac{2}{4}}"))
    assert good.value == 1.0 and good.details["extracted"] == "\\dfrac{2}{4}"
    assert _eval(task, _traj("Hence \\boxed{\\frac{1}{3}}")).value == 0.0
    assert _eval(task, _traj("")).value == 0.0


def test_eval_reads_submitted_then_final_text_then_messages():
    task = {"id": "m1", "question": "What is 3 + 4?", "answer": 7}
    assert _eval(task, _traj(final_text="I think 6", submitted="7")).value == 1.0
    assert _eval(task, _traj(final_text="\\boxed{7}")).value == 1.0
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}, {"role": "tool", "content": "6"}]
    assert _eval(task, _traj(messages=msgs)).value == 1.0


def test_messages_system_and_user():
    msgs = MathTask().messages({"id": 1, "question": "What is 2 + 2?", "answer": "4"}, tools=[])
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "\\boxed" in msgs[0]["content"] and msgs[1]["content"] == "What is 2 + 2?"
    assert "submit" not in msgs[0]["content"]
    assert "call submit" in MathTask().messages({"question": "q"}, tools=["submit"])[0]["content"]


def test_shipped_dataset():
    rows = MathTask().load("examples/math/train.jsonl", limit=None)
    assert len(rows) >= 32
    assert any(r["question"].startswith("What is") and "Answer with just the number" in r["question"] for r in rows)
    for r in rows:  # every reference answer is equivalent to itself once boxed
        assert _eval(r, _traj(f"\\boxed{{{r['answer']}}}")).value == 1.0


def _ticking(coro_fn):
    """(what `coro_fn()` returned, how often a 50-ms ticker ran on the loop meanwhile)."""
    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        try:
            return await coro_fn(), ticks
        finally:
            t.cancel()
    return asyncio.run(run())


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


@pytest.mark.timeout(120)
def test_an_answer_that_makes_sympy_compute_for_ever_is_stopped_and_scores_0(monkeypatch):
    """A model's answer that passes the whitelist but never finishes evaluating (`exp(exp(exp(99)))`: sympy did not
    return in 20 s) is stopped at the judgement's bound, with its worker (a thread could not be stopped: it would
    spin, holding the GIL, for the daemon's life); it scores 0, its details saying why, and the next judgement
    runs in a fresh worker. Meanwhile the daemon's loop is free (its beats, a weight update's fence: #38, an update
    waited ~2 s for a judgement on the loop)."""
    from rolloutd.agents.tasks import judge

    monkeypatch.setattr(judge, "JUDGE_SECONDS", 2.0)
    task = {"id": "m", "question": "?", "answer": "2"}
    assert _eval({"id": "w", "question": "?", "answer": "0.5"}, _traj("\\boxed{1/2}")).value == 1.0  # workers up
    workers = _children()
    reward, ticks = _ticking(lambda: MathTask().eval(task, None, _traj("\\boxed{exp(exp(exp(99)))}")))
    assert ticks >= 20, ticks  # ~40 in the 2 s when the loop is free; 0 when the judgement holds it
    assert reward.value == 0.0 and "over 2 s" in reward.details["judgement"]
    assert reward.details["extracted"] == "exp(exp(exp(99)))"
    assert _eval(task, _traj("\\boxed{4/2}")).value == 1.0
    replaced = lambda now: len(now) == len(workers) and now != workers  # noqa: E731
    now, deadline = _children(), time.monotonic() + 60  # pebble's manager starts the replacement on its own beat
    while not replaced(now) and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _children()
    assert replaced(now), (workers, now)  # the spinning worker is gone, replaced
