"""A job's node daemon logs as the executors hand them to `GET …/rolloutjobs/{name}/logs` (`rolloutctl logs`):
bounded tails of the files a job's daemons write, their growth while followed, several sources merged.

Called by the executors' `logs` (`local.py`: one file per daemon in the data dir's logs; `slurm/executor.py`: one
output file per allocation; `kubernetes/` streams its pods' logs through the API and merges them here). What is
read is only ever a file this controller named for the job (`job_files`: its own log directory, an exact name
pattern, no link followed): nothing of the request becomes a path. Each source sends at most `MAX_BYTES` of tail.
Next step: logs of a finished Kubernetes job (its pods are gone with it).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable

from rolloutd.crds.errors import ConfigurationError


TAIL_DEFAULT = 200     # lines per source unless asked otherwise
TAIL_MAX = 10_000
MAX_BYTES = 1 << 20    # the most a source's tail sends
READ_BYTES = 64 << 10  # read per poll while following
POLL_SECONDS = 0.25
HEARTBEAT_SECONDS = 1.0  # a quiet stream yields "" this often (the route checks whether the job ended)


class NoLogs(ConfigurationError, LookupError):
    """The job (or the node asked for) has no log yet: a 404 naming what is missing."""


def log_stem(job: str) -> str:
    """The start of a job's log file names ("namespace/name" → "namespace_name"; neither part holds a "_")."""
    return job.replace("/", "_")


def job_files(log_dir: Path, pattern: str) -> dict[int, Path]:
    """The files of `log_dir` whose whole name matches `pattern` (one group: a number), by that number;
    regular files only (a link is never followed)."""
    rx = re.compile(pattern)
    out: dict[int, Path] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(log_dir):
            m = rx.fullmatch(entry.name)
            if m and entry.is_file(follow_symlinks=False):
                out[int(m[1])] = Path(entry.path)
    return out


def _lines(data: bytes, keep: Callable[[str], bool] | None) -> list[str]:
    text = data.decode("utf-8", "replace").splitlines()
    return [line for line in text if keep is None or keep(line)]


async def follow_file(path: Path, tail: int, follow: bool,
                      keep: Callable[[str], bool] | None = None) -> AsyncIterator[str]:
    """The last `tail` lines of `path` (of its last MAX_BYTES), then, with `follow`, each complete line added to it;
    `keep` filters lines. Chunks are whole lines, each ending in a newline."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - MAX_BYTES, 0))
        data = f.read(MAX_BYTES)
        if size > MAX_BYTES:  # the first line is cut: drop it
            data = data.partition(b"\n")[2]
        partial = b""
        if follow and data and not data.endswith(b"\n"):  # the rest of that line comes with the next read
            data, _, partial = data.rpartition(b"\n")
        lines = _lines(data, keep)[-tail:] if tail else []
        if lines:
            yield "\n".join(lines) + "\n"
        while follow:
            chunk = f.read(READ_BYTES)
            if not chunk:
                await asyncio.sleep(POLL_SECONDS)
                continue
            data, _, partial = (partial + chunk).rpartition(b"\n")
            if lines := _lines(data, keep) if data else []:
                yield "\n".join(lines) + "\n"


async def merged(sources: dict[str, AsyncIterator[str]]) -> AsyncIterator[str]:
    """Every source's chunks as they come, each line prefixed with `[label] ` when there are several; "" after
    HEARTBEAT_SECONDS without any. Ends when every source has."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=16)
    labelled = len(sources) > 1

    async def pump(label: str, it: AsyncIterator[str]) -> None:
        try:
            async for chunk in it:
                if labelled:
                    chunk = "".join(f"[{label}] {line}\n" for line in chunk.splitlines())
                await queue.put(chunk)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(label, it)) for label, it in sources.items()]
    live = len(tasks)
    try:
        while live:
            try:
                chunk = await asyncio.wait_for(queue.get(), HEARTBEAT_SECONDS)
            except asyncio.TimeoutError:
                yield ""
                continue
            if chunk is None:
                live -= 1
            else:
                yield chunk
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


def pick(found: dict[int, Path], node: int | None, job: str, what: str) -> dict[int, Path]:
    """`found` narrowed to `node` (None: all); NoLogs when that leaves nothing."""
    chosen = found if node is None else {k: v for k, v in found.items() if k == node}
    if not chosen:
        raise NoLogs(f"rolloutjob {job} has no {what}" + ("" if node is None else f" for node {node}") + " yet")
    return chosen


def files_stream(files: Iterable[tuple[str, Path]], tail: int, follow: bool,
                 keep: Callable[[str], bool] | None = None) -> AsyncIterator[str]:
    """`merged` over `follow_file` of each (label, path)."""
    return merged({label: follow_file(path, tail, follow, keep) for label, path in files})
