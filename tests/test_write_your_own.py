"""The examples of the "write your own" pages (docs/content/write-a-*.md), loaded the way a user's would be: a
task kind, a sandbox runtime and an executor from a plug-in distribution (tests/plugins/write_your_own: one file each
and one entry point each in its dist-info), found through the registries; the dialect checked against its protocol."""
from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

from rolloutd.agents.tasks import get_handler, known_kinds
from rolloutd.agents.tasks.base import stash_answer
from rolloutd.agents.wire import Prompt, Turn
from rolloutd.agents.wire.dialect import Dialect, Events
from rolloutd.controller import executors
from rolloutd.controller.executors.base import Site
from rolloutd.controller.access.nodeauth import NodeCredentials
from rolloutd.crds.kit.settings import ControllerSettings
from rolloutd.crds.rolloutjob import RolloutJob, SandboxSpec
from rolloutd.crds.trajectory import Trajectory
from rolloutd.sandbox.runtimes import registered, runtime_class
from rolloutd.sandbox.runtimes.base import SandboxRuntime
from support.waiting import alive, until

PLUGINS = Path(__file__).resolve().parent / "plugins" / "write_your_own"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "content"


@pytest.fixture
def installed(monkeypatch):
    """The plug-in distribution on sys.path, as `pip install` would put it."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    importlib.invalidate_caches()


def test_a_task_kind_is_one_file_and_one_entry_point(installed, tmp_path):
    assert "word-count" in known_kinds()
    handler = get_handler("word-count")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "a", "text": "one two three"}) + "\n")
    [row] = handler.load(data)
    assert "one two three" in handler.messages(row, [])[-1]["content"]

    def scored(answer: str) -> float:
        t = stash_answer(Trajectory(job="j", prompt=0, sample=0), submitted=None, final_text=answer)
        return asyncio.run(handler.eval(row, None, t)).value

    assert (scored("It has 3 words."), scored("4")) == (1.0, 0.0)


def test_a_runtime_is_one_file_and_one_entry_point(installed):
    assert "nice-process" in registered()
    cls = runtime_class("nice-process")
    assert issubclass(cls, SandboxRuntime) and cls.name == "nice-process"

    async def niceness() -> tuple[str, dict]:
        sb = await cls().create(SandboxSpec(runtime="process"))
        try:
            return (await sb.bash("nice")).output.strip(), sb.limits
        finally:
            await sb.close()

    with pytest.warns(RuntimeWarning, match="NO ISOLATION"):
        got, limits = asyncio.run(niceness())
    assert got == str(min(19, os.nice(0) + 10)) and limits["niceness"] == 10


def test_an_executor_is_one_file_and_one_entry_point(installed, tmp_path):
    """The plug-in's daemon is a real `rolloutd node` (its controller never answers: it keeps registering), started
    10 steps nicer than this process, seen running, and gone after release."""
    assert "nice-local" in executors.registered()
    site = Site(tmp_path, NodeCredentials(None), ControllerSettings(), local_url="http://127.0.0.1:9",
                remote_url=lambda: "http://127.0.0.1:9", grace_seconds=5.0)
    ex = executors.make(["nice-local"], site)["nice-local"]
    assert type(ex).kind == "nice-local" and ex.shares_files
    job = RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "nice", "uid": "u-1"},
        "spec": {"tasks": {"kind": "math", "source": "/x.jsonl"}, "llm": {"tokenizer": "/t"}}})

    def program(pid: int) -> bytes:  # `nice` first, then the daemon's interpreter once nice has exec'd it
        try:
            return open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0]
        except OSError:
            return b""

    async def go() -> tuple[list, int]:
        await ex.ensure(job, 1)
        pid = ex.daemons[job.metadata.key][0].pid
        await until(lambda: program(pid) == sys.executable.encode(), 30, "nice to exec the daemon")
        niceness, states = os.getpriority(os.PRIO_PROCESS, pid), await ex.observe(job)
        await ex.release(job)
        await until(lambda: not alive(pid), 30, "the released daemon to exit")
        await ex.shutdown()
        return [(s.name, s.state) for s in states], niceness

    states, niceness = asyncio.run(go())
    assert states == [("nice-node0", "running")] and niceness == min(19, os.nice(0) + 10)


def _shape(fn) -> list[tuple]:
    import inspect
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_a_dialect_is_one_file_with_the_protocols_shape(installed):
    plain = importlib.import_module("plain_dialect")
    assert isinstance(plain, Dialect)
    for name in ("parse", "reply", "error"):
        assert _shape(getattr(plain, name)) == _shape(getattr(Dialect, name)), name
    for name in ("__init__", "start", "text", "end", "failed"):
        assert _shape(getattr(plain.Events, name)) == _shape(getattr(Events, name)), name
    prompt = plain.parse({"prompt": "hi", "max_tokens": 8})
    assert isinstance(prompt, Prompt) and prompt.messages == [{"role": "user", "content": "hi"}]
    assert plain.reply(Turn("hello", [], "stop", 2, 1), "policy")["text"] == "hello"


@pytest.mark.parametrize("page", ["write-a-task-kind.md", "write-a-runtime.md", "write-an-executor.md",
                                  "write-a-dialect.md"])
def test_each_page_shows_the_file_a_test_loads(page):
    text = (DOCS / page).read_text()
    example = {"write-a-task-kind.md": "wordcount_task.py", "write-a-runtime.md": "nice_runtime.py",
               "write-an-executor.md": "nice_executor.py", "write-a-dialect.md": "plain_dialect.py"}[page]
    assert f"tests/plugins/write_your_own/{example}" in text
