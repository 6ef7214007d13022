"""File operations: read with line ranges, write, str_replace edits, list."""
from __future__ import annotations

import pytest

from rolloutd.sandbox import ExecError, SandboxError


def test_write_then_read_with_line_ranges(sandbox, run):
    run(sandbox.write_file("pkg/mod.py", "one\ntwo\nthree\nfour\n"))
    assert (sandbox.workspace / "pkg" / "mod.py").read_text() == "one\ntwo\nthree\nfour\n"
    assert run(sandbox.read_file("pkg/mod.py")) == "one\ntwo\nthree\nfour\n"
    assert run(sandbox.read_file("pkg/mod.py", 2, 3)) == "two\nthree\n"
    assert run(sandbox.read_file("/workspace/pkg/mod.py", start_line=4)) == "four\n"
    assert run(sandbox.read_file("pkg/mod.py", end_line=1)) == "one\n"
    assert run(sandbox.read_file_info("pkg/mod.py")).total_lines == 4
    # bash sees the same file
    assert run(sandbox.bash("wc -l < pkg/mod.py")).output == "4\n"


def test_read_errors_are_exec_errors_not_infrastructure(sandbox, run):
    with pytest.raises(ExecError, match="no such file"):
        run(sandbox.read_file("missing.txt"))
    with pytest.raises(ExecError):
        run(sandbox.read_file("pkg"))  # a directory
    assert not issubclass(ExecError, SandboxError)


def test_write_outside_workspace_is_refused_by_the_sandbox(sandbox, run):
    with pytest.raises(ExecError, match="cannot write"):
        run(sandbox.write_file("/etc/evil", "x"))


def test_edit_file_str_replace_rules(sandbox, run):
    run(sandbox.write_file("e.txt", "alpha\nbeta\nbeta\ngamma\n"))
    run(sandbox.edit_file("e.txt", "alpha", "ALPHA"))
    assert run(sandbox.read_file("e.txt")) == "ALPHA\nbeta\nbeta\ngamma\n"
    with pytest.raises(ExecError, match="2 times"):
        run(sandbox.edit_file("e.txt", "beta", "BETA"))
    with pytest.raises(ExecError, match="not found"):
        run(sandbox.edit_file("e.txt", "delta", "DELTA"))
    with pytest.raises(ExecError, match="empty"):
        run(sandbox.edit_file("e.txt", "", "x"))
    run(sandbox.edit_file("e.txt", "beta\ngamma", "beta\nGAMMA"))  # multi-line, now unique
    assert run(sandbox.read_file("e.txt")) == "ALPHA\nbeta\nbeta\nGAMMA\n"
    with pytest.raises(ExecError, match="no such file"):
        run(sandbox.edit_file("nope.txt", "a", "b"))


def test_list_dir(sandbox, run):
    run(sandbox.bash("mkdir -p ls/sub && printf 12345 > ls/f && ln -sf f ls/link"))
    entries = {e.name: (e.type, e.size) for e in run(sandbox.list_dir("ls"))}
    assert entries["sub"][0] == "dir"
    assert entries["f"] == ("file", 5)
    assert entries["link"][0] == "symlink"
    with pytest.raises(ExecError):
        run(sandbox.list_dir("ls/f"))


def test_reads_are_bounded_whatever_sandboxed_code_makes_of_a_file(sandbox, run):
    """Sandboxed code decides how large its files are; the node reads at most `max_bytes` of one (16 MiB by
    default): the start, or the end of a log. A FIFO or a device is refused at once (it would block the
    server or never end), for reads and edits alike."""
    from rolloutd.sandbox.sandbox import READ_LIMIT

    run(sandbox.bash("head -c 100 /dev/zero | tr '\\0' a > big.log; printf 'THE END\\n' >> big.log; "
                     f"truncate -s {READ_LIMIT + (1 << 20)} sparse.bin; mkfifo pipe"))
    head = run(sandbox.read_file_info("big.log", max_bytes=10))
    assert (head.content, head.truncated) == ("a" * 10, True)
    end = run(sandbox.read_file_info("big.log", max_bytes=8, tail=True))
    assert (end.content, end.truncated) == ("THE END\n", True)
    whole = run(sandbox.read_file_info("big.log", max_bytes=108))
    assert (len(whole.content), whole.truncated) == (108, False)
    sparse = run(sandbox.read_file_info("sparse.bin"))  # larger than the default bound
    assert sparse.truncated and len(sparse.content) == READ_LIMIT
    for path in ("pipe", "/dev/zero"):
        with pytest.raises(ExecError, match="not a regular file"):
            run(sandbox.read_file(path))
    with pytest.raises(ExecError, match="not a regular file"):
        run(sandbox.edit_file("pipe", "a", "b"))
    with pytest.raises(ExecError, match="not a regular file"):
        run(sandbox.write_file("pipe", "x"))
    run(sandbox.write_file("big.log", "short"))  # a regular file is still rewritten whole
    assert run(sandbox.read_file("big.log")) == "short"
