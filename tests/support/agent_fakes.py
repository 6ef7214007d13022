"""Test doubles for the agent loop: a scripted LLM backend and an in-memory sandbox.

The scripted backend answers each turn with the ids of a given text (encoded by the real tokenizer
of the tiny model) + EOS, with made-up but distinct logprobs, and records every prompt it was sent.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rolloutd.agents.llm import BackendError, Generation, SamplingParams


class ScriptedLLM:
    def __init__(self, tokenizer, replies: list[str | Exception], *, close_with_eos: bool = True):
        self.tok = tokenizer
        self.replies = list(replies)
        self.close_with_eos = close_with_eos
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingParams] = []
        self.request_ids: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, prompt_ids, sampling, request_id):
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        self.request_ids.append(request_id)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        ids = self.tok.encode_text(reply)
        finish = "stop"
        if len(ids) >= sampling.max_tokens:
            ids, finish = ids[: sampling.max_tokens], "length"
        elif self.close_with_eos:
            ids.append(min(self.tok.eos_token_ids))
        logprobs = [-0.01 * (i + 1) - 0.001 * len(self.prompts) for i in range(len(ids))]
        return Generation(ids, logprobs, finish, list(prompt_ids), 0)

    async def abort(self, request_id):
        self.aborted.append(request_id)


@dataclass
class BashResult:
    output: str
    exit_code: int = 0
    timed_out: bool = False


@dataclass
class IPythonResult:
    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: str | None = None


from rolloutd.sandbox.errors import ExecError, SandboxDied, SandboxError  # noqa: E402


@dataclass
class FakeSandbox:
    files: dict[str, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    die_on: str | None = None
    hang_on: str | None = None

    async def bash(self, command, timeout=None):
        self.commands.append(command)
        if self.die_on and self.die_on in command:
            raise SandboxDied("exec server gone")
        if self.hang_on and self.hang_on in command:
            await asyncio.sleep(3600)
        if command.startswith("echo "):
            return BashResult(command[5:] + "\n")
        if command.startswith("sleep"):
            return BashResult("", exit_code=124, timed_out=True)
        return BashResult(f"bash: {command.split()[0]}: command not found\n", exit_code=127)

    async def ipython(self, code, timeout=None):
        try:
            return IPythonResult(result=repr(eval(code, {})))  # noqa: S307 - test double
        except Exception as e:  # noqa: BLE001
            return IPythonResult(error=f"{type(e).__name__}: {e}")

    async def read_file(self, path, start_line=None, end_line=None):
        if path not in self.files:
            raise ExecError(f"no such file: {path}")
        lines = self.files[path].splitlines(keepends=True)
        return "".join(lines[(start_line or 1) - 1: end_line])

    async def write_file(self, path, content):
        self.files[path] = content

    async def edit_file(self, path, old, new):
        text = self.files.get(path)
        if text is None or text.count(old) != 1:
            raise ExecError(f"old_str must occur exactly once in {path}")
        self.files[path] = text.replace(old, new)


__all__ = ["BackendError", "FakeSandbox", "ScriptedLLM", "SandboxDied", "SandboxError"]
