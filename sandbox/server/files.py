"""File operations inside the sandbox: read (line ranges), write, str_replace, list.

Where it sits: called by the in-sandbox execution server (`server/main.py`)
for the ``read_file``, ``write_file``, ``edit_file`` and ``list_dir``
requests. Relative paths are resolved against the workspace. A failure the
caller caused (missing file, ambiguous edit) raises `wire.RequestError`, which the
server returns as an ``ExecError``: it is a normal tool result for the agent,
not an infrastructure failure.
"""
from __future__ import annotations

import errno
import os
import stat

from .wire import RequestError


def resolve(workspace: str, path: str) -> str:
    return os.path.normpath(os.path.join(workspace, path))


def _open_regular(full: str, path: str, **text):
    """`full` opened for reading if it is a regular file: a FIFO would block the server and a device
    (/dev/zero) never end. Returns (file, size)."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open does not wait for a writer
    except FileNotFoundError:
        raise RequestError(f"no such file: {path}") from None
    except OSError as e:
        raise RequestError(f"cannot read {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RequestError(f"is a directory: {path}" if stat.S_ISDIR(st.st_mode) else f"not a regular file: {path}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r" if text else "rb", **text), st.st_size


def read_file(workspace: str, path: str, start_line: int | None, end_line: int | None,
              max_bytes: int | None = None, tail: bool = False) -> dict:
    """Lines are numbered from 1; both ends are inclusive; None means open-ended. With `max_bytes`, at most
    that many bytes of the file are read: its first ones, or with `tail` its last ones (`truncated`)."""
    full = resolve(workspace, path)
    f, size = _open_regular(full, path)
    try:
        with f:
            if max_bytes is not None and tail and size > max_bytes:
                f.seek(size - max_bytes)
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    except OSError as e:
        raise RequestError(f"cannot read {path}: {e.strerror}") from None
    truncated = max_bytes is not None and (len(data) > max_bytes or (tail and size > max_bytes))
    if max_bytes is not None:
        data = data[:max_bytes]
    text = data.decode("utf-8", "replace")
    if start_line is None and end_line is None:
        return {"content": text, "total_lines": text.count("\n") + (0 if text.endswith("\n") or not text else 1),
                "truncated": truncated}
    lines = text.splitlines(keepends=True)
    start = 1 if start_line is None else start_line
    end = len(lines) if end_line is None else end_line
    if start < 1 or end < start - 1:
        raise RequestError(f"bad line range {start_line}..{end_line}")
    return {"content": "".join(lines[start - 1 : end]), "total_lines": len(lines), "truncated": truncated}


def _write_regular(full: str, path: str, content: str) -> None:
    """Write `content` to `full`, a regular file or a new one: a FIFO without a reader would block the server."""
    try:
        os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO nobody reads
            raise RequestError(f"not a regular file: {path}") from None
        raise RequestError(f"cannot write {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RequestError(f"not a regular file: {path}")
    try:
        os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
    except OSError as e:
        raise RequestError(f"cannot write {path}: {e.strerror}") from None


def write_file(workspace: str, path: str, content: str) -> dict:
    full = resolve(workspace, path)
    _write_regular(full, path, content)
    return {"path": full, "bytes": len(content.encode())}


def edit_file(workspace: str, path: str, old: str, new: str) -> dict:
    """str_replace: `old` must occur exactly once (and must not be empty)."""
    if not old:
        raise RequestError("old must not be empty")
    full = resolve(workspace, path)
    f, _ = _open_regular(full, path, encoding="utf-8")
    try:
        with f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise RequestError(f"cannot read {path}: {e}") from None
    count = text.count(old)
    if count == 0:
        raise RequestError(f"old text not found in {path}")
    if count > 1:
        raise RequestError(f"old text occurs {count} times in {path}; make it unique")
    at = text.index(old)
    text = text[:at] + new + text[at + len(old) :]
    _write_regular(full, path, text)
    return {"path": full, "line": text.count("\n", 0, at) + 1}


def list_dir(workspace: str, path: str) -> dict:
    full = resolve(workspace, path)
    try:
        names = sorted(os.listdir(full))
    except FileNotFoundError:
        raise RequestError(f"no such directory: {path}") from None
    except NotADirectoryError:
        raise RequestError(f"not a directory: {path}") from None
    except OSError as e:
        raise RequestError(f"cannot list {path}: {e.strerror}") from None
    entries = []
    for name in names:
        try:
            st = os.lstat(os.path.join(full, name))
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            kind = "symlink"
        elif stat.S_ISDIR(st.st_mode):
            kind = "dir"
        elif stat.S_ISREG(st.st_mode):
            kind = "file"
        else:
            kind = "other"
        entries.append({"name": name, "type": kind, "size": st.st_size})
    return {"entries": entries}
