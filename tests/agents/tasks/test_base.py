"""The TaskHandler seam: entry-point lookup (built-ins and a plug-in installed at test time),
the unknown-kind error, dataset validation errors naming file, line and field, the answer stash."""
import asyncio
import textwrap

import pytest

from rolloutd.agents.tasks import DatasetError, TaskHandler, UnknownTaskKind, get_handler, known_kinds
from rolloutd.agents.tasks.base import answer_text, stash_answer
from rolloutd.agents.tasks.code import CodeTask
from rolloutd.agents.tasks.math import MathTask
from rolloutd.agents.tasks.stem import StemTask
from rolloutd.agents.tasks.swe import SweTask
from rolloutd.crds.trajectory import Trajectory


def test_builtins_resolve_through_entry_points():
    assert {"math", "stem", "code", "swe", "harbor"} <= set(known_kinds())
    assert isinstance(get_handler("math"), MathTask)
    assert isinstance(get_handler("stem"), StemTask)
    assert isinstance(get_handler("code"), CodeTask)
    assert isinstance(get_handler("swe"), SweTask)
    assert get_handler("code", reward="all").reward == "all"   # options reach the constructor


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(UnknownTaskKind, match=r"unknown task kind 'poetry'; known kinds: .*code, harbor, math, stem, swe"):
        get_handler("poetry")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A third-party distribution installed at test time: a dist-info with an entry point."""
    (tmp_path / "echo_tasks.py").write_text(textwrap.dedent('''
        from rolloutd.agents.tasks import Reward, TaskHandler

        class EchoTask(TaskHandler):
            name = "echo"
            needs_sandbox = False
            fields = {"id": str, "text": str}

            def __init__(self, bonus=0.0):
                self.bonus = bonus

            def messages(self, task, tools):
                return [{"role": "user", "content": "Repeat: " + task["text"]}]

            async def eval(self, task, sandbox, trajectory):
                return Reward(value=1.0 + self.bonus)

        not_a_handler = object
    '''))
    info = tmp_path / "echo_tasks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-tasks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[rolloutd.tasks]\necho = echo_tasks:EchoTask\nbroken = echo_tasks:missing\nweird = echo_tasks:not_a_handler\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    import sys
    sys.modules.pop("echo_tasks", None)


def test_plugin_registered_at_test_time(plugin):
    assert "echo" in known_kinds()
    handler = get_handler("echo", bonus=0.5)
    assert isinstance(handler, TaskHandler) and handler.bonus == 0.5
    assert asyncio.run(handler.eval({}, None, Trajectory(job="j", prompt=0, sample=0))).value == 1.5
    with pytest.raises(UnknownTaskKind, match=r"'broken': cannot load echo_tasks:missing"):
        get_handler("broken")
    with pytest.raises(UnknownTaskKind, match=r"'weird': .* returned object, not a TaskHandler"):
        get_handler("weird")


def test_same_kind_registered_twice_is_refused(plugin, tmp_path):
    info = tmp_path / "other-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rolloutd.tasks]\nmath = echo_tasks:EchoTask\n")
    with pytest.raises(UnknownTaskKind, match=r"'math' is registered more than once"):
        get_handler("math")


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "question": "q"}', r"bad\.jsonl:3: missing field 'answer'"),
    ('{"id": "a", "question": 5, "answer": "1"}', r"bad\.jsonl:3: field 'question' must be a string, got int"),
    ('{"id": "a", "question": "q", "answer": true}', r"bad\.jsonl:3: field 'answer' must be .*, got bool"),
    ('{"id": "a", "question": "q", "answer": " "}', r"bad\.jsonl:3: field 'answer' is empty"),
    ('{"id": "m0", "question": "q", "answer": "1"}', r"bad\.jsonl:3: field 'id': duplicate id \(first on line 1\)"),
    ('{"id": "a", "question": "q", ', r"bad\.jsonl:3: not valid JSON"),
    ('["a", "b"]', r"bad\.jsonl:3: a row must be a JSON object, got list"),
    ('{"id": ' + "1" * 5000 + "}", r"bad\.jsonl:3: a value cannot be read: Exceeds the limit"),  # was a ValueError
    ("[" * 100_000 + "]" * 100_000, r"bad\.jsonl:3: nests too deeply"),  # was a RecursionError
    ('{"id": "a", "question": "q", "answer": NaN}', r"bad\.jsonl:3: a value cannot be read: NaN is not a JSON number"),
    ('{"id": "a", "question": "q", "answer": 1e400}', r"bad\.jsonl:3: a value cannot be read: 1e400 is beyond a double"),
])
def test_dataset_errors_name_line_and_field(tmp_path, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "m0", "question": "1+1?", "answer": "2"}\n\n' + line + "\n")
    with pytest.raises(DatasetError, match=message):
        MathTask().load(p)


def test_dataset_limit_and_missing_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(f'{{"id": {i}, "question": "q", "answer": "{i}"}}\n' for i in range(5)) + "not json\n")
    assert [r["id"] for r in MathTask().load(p, limit=3)] == [0, 1, 2]   # stops before the bad line
    with pytest.raises(DatasetError, match="dataset file not found"):
        MathTask().load(tmp_path / "nope.jsonl")


def test_answer_stash_roundtrip():
    t = Trajectory(job="j", prompt=0, sample=0, messages=[{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}])
    assert answer_text(t) == "hi"
    stash_answer(t, submitted=None, final_text="final")
    assert t.reward_details == {"submitted": None, "final_text": "final"} and answer_text(t) == "final"
    stash_answer(t, submitted="42", final_text="final")
    assert answer_text(t) == "42"


def test_the_entry_point_scan_is_kept_until_a_path_changes(plugin, tmp_path, monkeypatch):
    """The scan (every distribution's metadata read) runs once per sys.path state: a job create looks handlers up on
    the controller's event loop (issue 36). A distribution installed later (a new *.dist-info) is still seen."""
    from rolloutd.agents.tasks import registry

    scans = []
    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda **kw: scans.append(kw) or real(**kw))
    known_kinds()
    get_handler("echo")
    known_kinds()
    assert len(scans) <= 1
    later = tmp_path / "later"
    (later / "late_tasks-0.1.dist-info").mkdir(parents=True)
    (later / "late_tasks-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: late\nVersion: 0.1\n")
    (later / "late_tasks-0.1.dist-info" / "entry_points.txt").write_text("[rolloutd.tasks]\nlate = echo_tasks:EchoTask\n")
    monkeypatch.syspath_prepend(str(later))
    assert "late" in known_kinds()
