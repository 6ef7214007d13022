"""stem handler: robust letter extraction, EVAL 1 for the key and 0 for another choice."""
import asyncio

import pytest

from rolloutd.agents.tasks.base import DatasetError, stash_answer
from rolloutd.agents.tasks.stem import StemTask, extract_choice
from rolloutd.crds.trajectory import Trajectory

CHOICES = ["Berlin", "Paris", "Rome", "Madrid"]


@pytest.mark.parametrize("text, letter", [
    ("The answer is (B)", "B"),
    ("B)", "B"),
    ("**B**", "B"),
    ("b", "B"),
    ("(b)", "B"),
    ("B. Paris", "B"),
    ("the answer is b", "B"),
    ("Answer: **b**", "B"),
    ("Final answer: (c)", "C"),
    ("The correct option is **D**.", "D"),
    ("\\boxed{B}", "B"),
    ("The answer is Paris.", "B"),                       # the choice's text instead of its letter
    ("Paris", "B"),
    ("It must be (D).", "D"),
    ("Listing: A) Berlin B) Paris C) Rome. The answer is C", "C"),   # restated choices do not fool it
    ("I first thought A, but the answer is B.", "B"),
    ("The answer is a city in France: Paris", "B"),      # lowercase article "a" is not choice A
    ("answer: a", "A"),
    ("The answer is A", "A"),
])
def test_extract_choice(text, letter):
    assert extract_choice(text, CHOICES) == letter


@pytest.mark.parametrize("text", ["", "Hmm, hard to say.", "Either Paris or Rome.", "The answer is E"])
def test_extract_choice_none(text):
    assert extract_choice(text, CHOICES) is None


def _eval(task, final_text):
    t = stash_answer(Trajectory(job="j", prompt=0, sample=0), submitted=None, final_text=final_text)
    return asyncio.run(StemTask().eval(task, None, t))


def test_eval_known_good_and_bad():
    task = {"id": "s1", "question": "Capital of France?", "choices": CHOICES, "answer": "B"}
    assert _eval(task, "The answer is (B)").value == 1.0
    assert _eval(task, "The answer is Paris").value == 1.0
    bad = _eval(task, "The answer is (C)")
    assert bad.value == 0.0 and bad.details == {"extracted": "C", "expected": "B", "submitted": None,
                                                "final_text": "The answer is (C)"}


def test_messages_list_the_choices():
    msgs = StemTask().messages({"id": 1, "question": "Capital?", "choices": ["(A) Berlin", "Paris"], "answer": "B"}, [])
    assert msgs[1]["content"] == "Capital?\n\nA) Berlin\nB) Paris"


def test_dataset_answer_must_be_a_listed_letter(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"id": 1, "question": "q", "choices": ["x", "y"], "answer": 1}\n'
                 '{"id": 2, "question": "q", "choices": ["x", "y"], "answer": "c"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: field 'answer' must be one of A, B \(or a choice's index\)"):
        StemTask().load(p)
    assert StemTask().load(p, limit=1)[0]["answer"] == "B"   # an index becomes its letter


def test_shipped_dataset():
    rows = StemTask().load("examples/stem/train.jsonl")
    assert len(rows) >= 32
    for r in rows:
        assert _eval(r, f"The answer is ({r['answer']})").value == 1.0
