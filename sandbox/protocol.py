"""Pydantic models of the sandbox seam: the spec a caller asks for, and the results it gets back.

Where it sits: used by every runtime and by `Sandbox` (node side); the agents
(`rolloutd.agents`) build a `SandboxSpec` from a RolloutJob's ``sandbox``
section and read `BashResult` / `IPythonResult`. The wire requests to the
execution server are the `*Request` models below, one per operation, joined
in the `Request` discriminated union on ``op``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..crds.mounts import check_mount_paths

RuntimeName = Literal["bwrap", "apptainer", "process"]


class Mount(BaseModel):
    """A host path shown in the sandbox. Secrets and rolloutd's own state are refused at creation."""

    model_config = ConfigDict(extra="forbid")

    host_path: str
    path: str | None = Field(None, description="where it appears inside (default: host_path)")
    read_only: bool = True

    @model_validator(mode="after")
    def _policy(self) -> "Mount":
        check_mount_paths(self.host_path, self.inside)
        return self

    @property
    def inside(self) -> str:
        return self.path or self.host_path


class SandboxSpec(BaseModel):
    """What a sandbox must be. Defaults are safe: bwrap, host image read-only, no network."""

    model_config = ConfigDict(extra="forbid")

    runtime: RuntimeName = "bwrap"
    image: str = Field(
        "host",
        description='"host" (the host root, read-only), a root filesystem directory, or a .sif file (apptainer)',
    )
    network: bool = False
    memory_mb: int | None = Field(2048, ge=16, description="address-space rlimit per process and, where possible, a cgroup memory limit")
    processes: int | None = Field(256, ge=8, description="process limit (cgroup pids.max where possible; RLIMIT_NPROC for non-root)")
    file_size_mb: int | None = Field(1024, ge=1, description="largest file a process may write (RLIMIT_FSIZE)")
    wall_seconds: float | None = Field(3600.0, gt=0, description="the sandbox is killed this long after it starts")
    tmp_mb: int | None = Field(1024, ge=1, description="size of the private /tmp (tmpfs)")
    env: dict[str, str] = Field(default_factory=dict)
    mounts: list["Mount"] = Field(
        default_factory=list, description="host paths a task really needs (read-only unless said otherwise)"
    )

    @classmethod
    def from_limits(
        cls,
        *,
        runtime: RuntimeName = "bwrap",
        image: str = "host",
        network: bool = False,
        limits: dict[str, Any] | None = None,
        **extra: Any,
    ) -> "SandboxSpec":
        """Build from a RolloutJob-style section: ``limits: {memoryMB, processes, wallSeconds, fileSizeMB}``."""
        limits = limits or {}
        names = {"memoryMB": "memory_mb", "processes": "processes", "wallSeconds": "wall_seconds", "fileSizeMB": "file_size_mb"}
        mapped = {names[k]: v for k, v in limits.items() if k in names and v is not None}
        return cls(runtime=runtime, image=image, network=network, **mapped, **extra)


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


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BashRequest(_Req):
    op: Literal["bash"] = "bash"
    command: str
    session: str = "default"
    timeout: float = 30.0
    max_output: int = 16384


class SendInputRequest(_Req):
    op: Literal["send_input"] = "send_input"
    text: str
    session: str = "default"


class InterruptRequest(_Req):
    op: Literal["interrupt"] = "interrupt"
    session: str = "default"


class CloseSessionRequest(_Req):
    op: Literal["close_session"] = "close_session"
    session: str = "default"


class IPythonRequest(_Req):
    op: Literal["ipython"] = "ipython"
    code: str
    timeout: float = 30.0


class IPythonInterruptRequest(_Req):
    op: Literal["ipython_interrupt"] = "ipython_interrupt"


class ReadFileRequest(_Req):
    op: Literal["read_file"] = "read_file"
    path: str
    start_line: int | None = None
    end_line: int | None = None


class WriteFileRequest(_Req):
    op: Literal["write_file"] = "write_file"
    path: str
    content: str


class EditFileRequest(_Req):
    op: Literal["edit_file"] = "edit_file"
    path: str
    old: str
    new: str


class ListDirRequest(_Req):
    op: Literal["list_dir"] = "list_dir"
    path: str = "."


class HealthRequest(_Req):
    op: Literal["health"] = "health"


class ShutdownRequest(_Req):
    op: Literal["shutdown"] = "shutdown"


Request = Annotated[
    Union[
        BashRequest,
        SendInputRequest,
        InterruptRequest,
        CloseSessionRequest,
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
    "RuntimeName",
    "SandboxSpec",
]
