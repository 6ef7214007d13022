"""The execution server's protocol, node side: one request model per operation, and the results.

Where it sits: `sandbox.Sandbox` builds the `*Request` models (joined in the `Request` union on
``op``) and `client.ExecClient` sends them; the agents read `BashResult` / `IPythonResult`.
What a sandbox must be is `rolloutd.crds.rolloutjob.SandboxSpec`, not here.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class BashResult(BaseModel):
    """One command's result. A non-zero exit code or a timeout is a normal result."""

    output: str
    exit_code: int | None = Field(description="$? of the command (130 after Ctrl-C); None if unknown")
    duration: float = Field(description="seconds, measured inside the sandbox")
    truncated: bool = False
    timed_out: bool = False
    session_ended: bool = Field(False, description="the bash process ended (exit, or killed after a timeout); the next command starts a fresh session")


class IPythonResult(BaseModel):
    stdout: str = ""
    stderr: str = ""
    result: str | None = Field(None, description="text/plain of the cell's value")
    error: str | None = Field(None, description="traceback as text (ANSI removed), or a note from rolloutd")
    images: list[str] = Field(default_factory=list, description="base64-encoded PNG images")
    timed_out: bool = False
    kernel_restarted: bool = Field(False, description="the kernel died or was restarted: its state is lost")
    duration: float = 0.0


class FileContent(BaseModel):
    content: str
    total_lines: int
    truncated: bool = False  # more of the file than `max_bytes` was left unread


class DirEntry(BaseModel):
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int


class Health(BaseModel):
    pid: int
    uptime: float
    sessions: list[str]
    kernel: bool


# -- wire requests (node → execution server) -------------------------------


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BashRequest(RequestModel):
    op: Literal["bash"] = "bash"
    command: str
    session: str = "default"
    timeout: float = 30.0
    max_output: int = 16384


class SendInputRequest(RequestModel):
    op: Literal["send_input"] = "send_input"
    text: str
    session: str = "default"


class InterruptRequest(RequestModel):
    op: Literal["interrupt"] = "interrupt"
    session: str = "default"


class CloseSessionRequest(RequestModel):
    op: Literal["close_session"] = "close_session"
    session: str = "default"


class ConfineRequest(RequestModel):
    """Confine every session and kernel started from now on, but `exempt` sessions (server/confine.py)."""
    op: Literal["confine"] = "confine"
    exempt: list[str] = []


class Confinement(BaseModel):
    confined: bool
    reason: str | None = None  # why not
    abi: int | None = None
    signals_scoped: bool = False  # ABI 6+: a confined process cannot signal one outside its domain


class IPythonRequest(RequestModel):
    op: Literal["ipython"] = "ipython"
    code: str
    timeout: float = 30.0


class IPythonInterruptRequest(RequestModel):
    op: Literal["ipython_interrupt"] = "ipython_interrupt"


class ReadFileRequest(RequestModel):
    op: Literal["read_file"] = "read_file"
    path: str
    start_line: int | None = None
    end_line: int | None = None
    max_bytes: int | None = Field(default=None, ge=0)  # read at most this much (the file's start, or its end)
    tail: bool = False


class WriteFileRequest(RequestModel):
    op: Literal["write_file"] = "write_file"
    path: str
    content: str


class EditFileRequest(RequestModel):
    op: Literal["edit_file"] = "edit_file"
    path: str
    old: str
    new: str


class ListDirRequest(RequestModel):
    op: Literal["list_dir"] = "list_dir"
    path: str = "."


class HealthRequest(RequestModel):
    op: Literal["health"] = "health"


class ShutdownRequest(RequestModel):
    op: Literal["shutdown"] = "shutdown"


Request = Annotated[
    Union[
        BashRequest,
        SendInputRequest,
        InterruptRequest,
        CloseSessionRequest,
        ConfineRequest,
        IPythonRequest,
        IPythonInterruptRequest,
        ReadFileRequest,
        WriteFileRequest,
        EditFileRequest,
        ListDirRequest,
        HealthRequest,
        ShutdownRequest,
    ],
    Field(discriminator="op"),
]

__all__ = [
    "BashResult",
    "DirEntry",
    "FileContent",
    "Health",
    "IPythonResult",
    "Request",
]
