"""IPython through the whole path: client → UDS → exec server → the kernel process (IPython over two pipes)."""
from __future__ import annotations

import base64
import struct
import zlib


def _png(width: int = 2, height: int = 2) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def test_state_persists_across_cells(sandbox, run):
    r = run(sandbox.ipython("x = 41\ndef f(y):\n    return y + 1"))
    assert r.error is None and r.result is None
    r = run(sandbox.ipython("f(x)"))
    assert r.result == "42"
    assert run(sandbox.health()).kernel


def test_stdout_stderr_and_result(sandbox, run):
    r = run(sandbox.ipython("import sys\nprint('out')\nprint('err', file=sys.stderr)\n'value'"))
    assert (r.stdout, r.stderr, r.result) == ("out\n", "err\n", "'value'")


def test_exception_comes_back_as_text(sandbox, run):
    r = run(sandbox.ipython("def boom():\n    raise ValueError('bad input')\nboom()"))
    assert r.error is not None
    assert "ValueError" in r.error and "bad input" in r.error and "boom()" in r.error
    assert "\x1b[" not in r.error
    assert not r.kernel_restarted
    assert run(sandbox.ipython("1 + 1")).result == "2"  # the kernel is fine


def test_infinite_loop_is_interrupted_and_state_kept(sandbox, run):
    run(sandbox.ipython("kept = 'yes'"))
    r = run(sandbox.ipython("while True:\n    pass", timeout=1))
    assert r.timed_out
    assert "KeyboardInterrupt" in (r.error or "")
    assert not r.kernel_restarted
    assert run(sandbox.ipython("kept")).result == "'yes'"


def test_images_come_back_as_base64_png(sandbox, run):
    png = _png()
    code = f"from IPython.display import Image, display\ndisplay(Image(data={png!r}))"
    r = run(sandbox.ipython(code))
    assert r.error is None, r.error
    assert len(r.images) == 1
    assert base64.b64decode(r.images[0]) == png


def test_kernel_death_is_reported_and_next_cell_gets_a_new_kernel(sandbox, run):
    run(sandbox.ipython("doomed = 1"))
    r = run(sandbox.ipython("import os\nos._exit(3)", timeout=30))
    assert r.kernel_restarted and "died" in (r.error or "")
    r = run(sandbox.ipython("'doomed' in dir()"))
    assert r.result == "False"


def test_memory_bomb_in_a_cell_under_a_small_limit(make_sandbox, run):
    sb = make_sandbox(memory_mb=256)
    run(sb.ipython("survivor = 1"))
    r = run(sb.ipython("hog = []\nwhile True:\n    hog.append(bytearray(10**7))", timeout=60))
    assert not r.timed_out
    if r.kernel_restarted:  # killed by the cgroup: reported, and the next cell works
        assert "died" in (r.error or "")
        assert run(sb.ipython("1 + 1")).result == "2"
    else:  # stopped by RLIMIT_AS: an ordinary exception, state kept
        assert "MemoryError" in (r.error or "")
        assert run(sb.ipython("del hog; survivor")).result == "1"
