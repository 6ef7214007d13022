"""The example of docs/content/write-a-task-kind.md: a task kind in one file, registered by one entry point.

A row is `{"id": ..., "text": ...}`; the agent is asked how many words the text has; the reward is 1 when its
answer is that number. Loaded through the registry by tests/test_write_your_own.py.
"""
from __future__ import annotations

import re
from typing import ClassVar

from rolloutd.agents.tasks.base import Reward, TaskHandler, answer_text
from rolloutd.agents.tasks.seams import Sandbox, SandboxFactory
from rolloutd.crds.trajectory import Trajectory


class WordCountTask(TaskHandler):
    name = "word-count"
    fields: ClassVar[dict] = {"id": (str, int), "text": str}
    needs_sandbox = False  # scored from the answer alone; the job's tools may still ask for one

    def validate_row(self, row: dict, *, base_dir) -> None:
        if not row["text"].strip():
            raise ValueError("field 'text' is empty")

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        return [{"role": "system", "content": "Answer with one number."},
                {"role": "user", "content": f"How many words does this text have?\n\n{task['text']}"}]

    async def eval(self, task: dict, sandbox: Sandbox | None, trajectory: Trajectory, *,
                   sandbox_factory: SandboxFactory | None = None) -> Reward:
        answer = answer_text(trajectory)
        numbers = re.findall(r"-?\d+", answer)
        want = len(task["text"].split())
        got = int(numbers[-1]) if numbers else None
        return Reward(value=float(got == want), details={"answer": got, "words": want})
