"""The typed seam a task handler sees: the `Sandbox` it stages, runs and scores in, the `LLM` it asks, the
model's `Tokenizer`, the job's `AgentConfig`, the rollout's `RolloutContext` and EVAL's `SandboxFactory`.

Where it sits: `TaskHandler.init/run/eval` (agents/tasks/base.py) take these; the node pipeline
(agents/daemon/pipeline.py) passes the real ones — `rolloutd.sandbox.Sandbox`, the pinned backend
(`VLLMBackend` behind `TrackedLLM`) and `agents.tokenizer.ChatTokenizer`. A plug-in handler or a test may pass
anything that has the same methods: tests/agents/test_seams.py checks that the real classes match these
signatures exactly. The job's limits and the rollout's identity are the daemon's own frozen values
(`AgentConfig`, `RolloutContext`, agents/loop/rollout.py): a handler reads them, never implements them. The next
step: the agent loop (agents/loop/run.py), which drives the sandbox and the LLM through the tools (agents/loop/tools.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

from rolloutd.sandbox.protocol import BashResult, Confinement, DirEntry, FileContent, IPythonResult
from rolloutd.sandbox.sandbox import READ_LIMIT

from ..llm import LLMBackend
from ..loop.rollout import AgentConfig, RolloutContext

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


@runtime_checkable
class HostSandbox(Sandbox, Protocol):
    """A sandbox as the node sees it from outside (`rolloutd.sandbox.Sandbox`): what a handler that stages files
    on the host (swe's repository, harbor's task folders) or starts a sandbox like it (swe's EVAL) reads."""

    spec: Any       # the `rolloutd.sandbox.SandboxSpec` it was created from
    root: Path      # its directory on the host (ctl/ holds the server's sockets)
    workspace: Path  # the host path of its writable workspace
    limits: dict    # what is actually enforced (`{"isolation": "none"}`: no pid namespace of its own)

    def give(self, path: Path | str) -> None: ...


# What EVAL gets when the handler scores in a fresh sandbox (`TaskHandler.eval_sandbox`): an async callable
# returning one, started by the daemon as RUN ended; the daemon closes it if EVAL does not.
SandboxFactory = Callable[[], Awaitable[Sandbox]]


class Tokenizer(Protocol):
    """The model's tokenizer and chat template as the agent loop and the harness gateway use it
    (`agents.tokenizer.ChatTokenizer`). None in `run` when the job names no tokenizer (no LLM)."""

    template: str
    observation_role: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    @property
    def supports_tools(self) -> bool: ...

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = False) -> str: ...

    def encode_text(self, text: str) -> list[int]: ...

    def encode_text_in_thread(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decode_content(self, ids: list[int]) -> str: ...

    def encode_observation(self, content: str, *, closed: bool = True) -> list[int]: ...


__all__ = ["LLM", "AgentConfig", "HostSandbox", "RolloutContext", "Sandbox", "SandboxFactory", "Tokenizer"]
