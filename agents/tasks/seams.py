"""The typed seam a task handler sees: the `Sandbox` it stages, runs and scores in, and the `LLM` it asks.

Where it sits: `TaskHandler.init/run/eval` (agents/tasks/base.py) take these; the node pipeline
(agents/daemon/pipeline.py) passes the real ones — `rolloutd.sandbox.Sandbox` and the pinned backend
(`VLLMBackend` behind `TrackedLLM`). A plug-in handler or a test may pass anything that has the same methods:
tests/agents/test_seams.py checks that the real classes match these signatures exactly. The next step:
the agent loop (agents/loop.py), which drives both through the tools (agents/tools.py).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from rolloutd.sandbox.protocol import BashResult, Confinement, DirEntry, FileContent, IPythonResult
from rolloutd.sandbox.sandbox import READ_LIMIT

from ..llm import LLMBackend

# What a handler asks for tokens: `generate(prompt_ids, sampling, request_id)` and `abort(request_id)`, the
# one protocol every backend already satisfies (agents/llm.py); named here as the handler sees it.
LLM = LLMBackend


@runtime_checkable
class Sandbox(Protocol):
    """One task's sandbox: persistent bash, an IPython kernel and the workspace's files. A failing request
    the policy controls raises `ExecError` (an agent error); the sandbox failing raises `SandboxError` (infra)."""

    async def bash(self, command: str, session: str = "default", timeout: float = 30.0,
                   max_output: int = 16384) -> BashResult: ...

    async def ipython(self, code: str, timeout: float = 30.0) -> IPythonResult: ...

    async def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None, *,
                        max_bytes: int = READ_LIMIT, tail: bool = False) -> str: ...

    async def read_file_info(self, path: str, start_line: int | None = None, end_line: int | None = None, *,
                             max_bytes: int = READ_LIMIT, tail: bool = False) -> FileContent: ...

    async def write_file(self, path: str, content: str) -> None: ...

    async def edit_file(self, path: str, old: str, new: str) -> None: ...

    async def list_dir(self, path: str = ".") -> list[DirEntry]: ...

    async def confine(self, exempt: list[str]) -> Confinement: ...

    async def close(self) -> None: ...
