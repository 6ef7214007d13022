"""The agent's tools: their specs, the parser of tool calls in generated text, and their execution
in a sandbox.

Where it sits: the agent loop (agents/loop/run.py) calls `tool_specs` / `tool_instructions` to describe
the tools in the prompt, `parse_tool_calls` on every assistant turn's decoded text, and
`execute` for each call; `execute` talks to the sandbox interface (`rolloutd.sandbox`:
`bash`, `ipython`, `read_file`, `write_file`, `edit_file`).

Formats parsed: the model family's (agents/toolcall_formats.py: Hermes/Qwen `<tool_call>`, Llama 3
JSON, Mistral `[TOOL_CALLS]`, read from the chat template), and, only when the turn holds no call in
that format, a fenced-code fallback: a ```bash / ```sh block is a bash call, a
```python block an ipython call. A malformed call is not an exception for the episode: it becomes
a `ToolCall` with `error` set, whose observation tells the model what was wrong.

Tools: `bash(command)`, `ipython(code)`, `editor(command=view|create|str_replace, path, ...)`,
`submit(answer)` (ends the episode).
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any
from rolloutd.crds.errors import InfraError

from rolloutd.sandbox.errors import ExecError, SandboxError

from ..toolcall_formats import FORMATS, Format

TOOL_NAMES = ("bash", "ipython", "editor", "submit")
MAX_OBSERVATION_CHARS = 8000

_SPECS: dict[str, dict[str, Any]] = {
    "bash": {
        "description": "Run a bash command in a persistent shell; returns its output and exit code.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
    "ipython": {
        "description": "Run Python code in a persistent IPython kernel; returns stdout, stderr and the result.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
    "editor": {
        "description": "View, create or edit a file. command=view (optional view_range [start, end]), "
                       "create (file_text), str_replace (old_str -> new_str, old_str must be unique).",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": ["view", "create", "str_replace"]},
                "path": {"type": "string"},
                "file_text": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
                "view_range": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["command", "path"],
        },
    },
    "submit": {
        "description": "Submit the final answer and end the episode.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}
_REQUIRED = {name: spec["parameters"]["required"] for name, spec in _SPECS.items()}


def tool_specs(names: list[str]) -> list[dict[str, Any]]:
    """OpenAI-style function specs (what `apply_chat_template(tools=...)` takes)."""
    unknown = [n for n in names if n not in _SPECS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; known: {list(_SPECS)}")
    return [{"type": "function", "function": {"name": n, **_SPECS[n]}} for n in names]


def tool_instructions(names: list[str]) -> str:
    """A plain-text tool description for chat templates that do not render `tools=`."""
    lines = ["You can use these tools:"]
    for spec in tool_specs(names):
        fn = spec["function"]
        args = ", ".join(fn["parameters"]["properties"])
        lines.append(f"- {fn['name']}({args}): {fn['description']}")
    lines.append('To call a tool, write <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
                 " and wait for its result.")
    if "bash" in names:
        lines.append("A ```bash code block is also run as a bash command.")
    if "submit" in names:
        lines.append('When done, call <tool_call>{"name": "submit", "arguments": {"answer": "..."}}</tool_call>.')
    return "\n".join(lines)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the call is malformed; the observation reports it
    format: str = "hermes"  # a toolcall_formats name, or "fenced"

    def wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "arguments": self.arguments, "format": self.format}
        if self.error:
            d["error"] = self.error
        return d


_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)
_FENCE_TOOL = {"bash": "bash", "sh": "bash", "shell": "bash", "console": "bash",
               "python": "ipython", "py": "ipython", "ipython": "ipython", "python3": "ipython"}


def _validate(name: Any, args: Any, allowed: list[str]) -> str | None:
    if not isinstance(name, str) or not name:
        return 'the call has no "name"'
    if name not in allowed:
        return f"unknown tool {name!r}; available: {', '.join(allowed)}"
    if not isinstance(args, dict):
        return f'"arguments" of {name} must be a JSON object'
    missing = [k for k in _REQUIRED.get(name, []) if k not in args]
    if missing:
        return f"{name} needs {', '.join(missing)}"
    return None


def parse_tool_calls(text: str, allowed: list[str], fmt: Format | None = None) -> list[ToolCall]:
    """All tool calls in one assistant turn, in order, in the model family's format `fmt`
    (agents/toolcall_formats.py; Hermes when not given). Empty list: a final answer."""
    fmt = fmt or FORMATS["hermes"]
    raw = fmt.parse(text)
    if raw:
        return [ToolCall(c.name, c.arguments, c.error or _validate(c.name, c.arguments, allowed), fmt.name)
                for c in raw]
    calls: list[ToolCall] = []
    for m in _FENCE.finditer(text):
        tool = _FENCE_TOOL.get(m.group(1).lower())
        if tool is None or tool not in allowed:
            continue
        body = m.group(2).rstrip("\n")
        if not body.strip():
            continue
        key = "command" if tool == "bash" else "code"
        calls.append(ToolCall(tool, {key: body}, None, "fenced"))
    return calls


@dataclass
class ToolResult:
    observation: str
    submitted: str | None = None  # set by `submit`
    ok: bool = True


def _clip(text: str) -> str:
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    half = MAX_OBSERVATION_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def is_infra_error(exc: BaseException) -> bool:
    """Sandbox infrastructure failures (`SandboxError` and subclasses: died, timed out, could not
    start) propagate: the rollout is retried, never scored. `ExecError` is a tool result."""
    return isinstance(exc, SandboxError)


async def execute(call: ToolCall, sandbox: Any, timeout: float) -> ToolResult:
    """Run one (well-formed) call. Policy mistakes (bad path, command fails, timeout) come back
    as observations (`ExecError` included); sandbox failures (`SandboxError`), a hung sandbox and
    any other exception propagate (`ToolInfraError`): they are infrastructure failures."""
    if call.error:
        return ToolResult(f"Error: {call.error}", ok=False)
    a = call.arguments
    if call.name == "submit":
        return ToolResult("Submitted.", submitted=str(a.get("answer", "")))
    if sandbox is None:
        return ToolResult(f"Error: the {call.name} tool is not available in this task (no sandbox).", ok=False)
    # the sandbox enforces `timeout` itself; the outer bound only catches a sandbox that hangs
    guard = timeout + 30.0
    try:
        if call.name == "bash":
            r = await asyncio.wait_for(sandbox.bash(str(a["command"]), timeout=timeout), guard)
            out = _clip(r.output or "")
            if r.timed_out:
                return ToolResult(f"{out}\n[command timed out after {timeout:g}s]".lstrip(), ok=False)
            return ToolResult(f"{out}\n[exit code {r.exit_code}]".lstrip(), ok=r.exit_code == 0)
        if call.name == "ipython":
            r = await asyncio.wait_for(sandbox.ipython(str(a["code"]), timeout=timeout), guard)
            parts = [r.stdout or "", r.stderr or ""]
            if r.result:
                parts.append(f"Out: {r.result}")
            if r.error:
                parts.append(r.error)
            if getattr(r, "timed_out", False):
                parts.append(f"[cell timed out after {timeout:g}s]")
            text = "\n".join(p for p in parts if p) or "[no output]"
            return ToolResult(_clip(text), ok=not r.error and not getattr(r, "timed_out", False))
        if call.name == "editor":
            return await asyncio.wait_for(_editor(a, sandbox), guard)
    except asyncio.TimeoutError as e:
        raise ToolHung(f"{call.name} did not return within {guard:g}s") from e
    except ExecError as e:  # the request failed for a reason the agent controls: show it
        return ToolResult(f"Error: {e}", ok=False)
    except SandboxError:
        raise
    except Exception as e:  # our machinery broke, not the policy: never an observation
        raise ToolInfraError(f"{call.name}: {type(e).__name__}: {e}") from e
    return ToolResult(f"Error: unknown tool {call.name!r}", ok=False)


class ToolInfraError(InfraError):
    """Executing a tool failed for a reason that is not the policy's (infra, never a reward)."""


class ToolHung(ToolInfraError):
    """The sandbox did not answer within the action timeout plus a grace period."""


async def _editor(a: dict[str, Any], sandbox: Any) -> ToolResult:
    cmd, path = a.get("command"), str(a.get("path", ""))
    if cmd == "view":
        rng = a.get("view_range")
        start = end = None
        if rng is not None:
            if not (isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng)):
                return ToolResult("Error: view_range must be [start_line, end_line]", ok=False)
            start, end = rng
        text = await sandbox.read_file(path, start_line=start, end_line=end)
        return ToolResult(_clip(text if isinstance(text, str) else str(text)))
    if cmd == "create":
        if "file_text" not in a:
            return ToolResult("Error: create needs file_text", ok=False)
        await sandbox.write_file(path, str(a["file_text"]))
        return ToolResult(f"File created: {path}")
    if cmd == "str_replace":
        if "old_str" not in a:
            return ToolResult("Error: str_replace needs old_str", ok=False)
        await sandbox.edit_file(path, str(a["old_str"]), str(a.get("new_str", "")))
        return ToolResult(f"File edited: {path}")
    return ToolResult(f"Error: editor command must be view, create or str_replace, not {cmd!r}", ok=False)
