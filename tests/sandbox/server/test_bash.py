"""Bash semantics through the whole path: client → UDS → exec server → pty bash."""
from __future__ import annotations

import asyncio
import signal

import pytest

from support.sandbox_checks import require_bwrap

from rolloutd.sandbox import ExecError, SandboxSpec, get_runtime


def test_exit_codes(sandbox, run):
    assert run(sandbox.bash("true")).exit_code == 0
    assert run(sandbox.bash("false")).exit_code == 1
    r = run(sandbox.bash("(exit 42)"))
    assert (r.exit_code, r.timed_out, r.session_ended) == (42, False, False)
    assert run(sandbox.bash("ls /nonexistent-dir")).exit_code == 2


def test_multiline_command_and_output(sandbox, run):
    r = run(sandbox.bash("for i in 1 2 3\ndo\n  echo line $i\ndone\ncat <<'EOF'\nheredoc $HOME\nEOF"))
    assert r.output == "line 1\nline 2\nline 3\nheredoc $HOME\n"
    assert r.exit_code == 0


def test_the_terminal_keeps_newlines_and_does_not_echo(sandbox, run):
    """The session's pty is set before bash starts: no echo, and "\\n" is not turned into "\\r\\n" (onlcr off),
    in the first session and in a later one alike."""
    for session in ("default", "second"):
        r = run(sandbox.bash("stty -a", session=session))
        flags = r.output.split()
        assert r.exit_code == 0 and "-onlcr" in flags and "-echo" in flags, r.output


def test_output_without_final_newline(sandbox, run):
    r = run(sandbox.bash("printf 'no newline'"))
    assert r.output == "no newline"
    assert r.exit_code == 0


def test_binaryish_output_and_ansi(sandbox, run):
    r = run(sandbox.bash(r"printf 'a\x00b\xff\xfec\n'; printf '\033[31mred\033[0m\n'; printf 'progress 10%%\rprogress 100%%\n'"))
    lines = r.output.split("\n")
    assert lines[0] == "ab\ufffd\ufffdc"
    assert lines[1] == "red"
    assert lines[2] == "progress 100%"
    assert r.exit_code == 0


def test_text_is_utf8_by_default(sandbox, run):
    # the default environment sets LC_CTYPE only (cheaper than LANG for every program that calls
    # setlocale): characters, file names and Python's streams must still be UTF-8
    r = run(sandbox.bash("touch /tmp/café.txt; ls /tmp | grep caf; printf 'é' | wc -m; "
                         "python3 -c 'import sys; print(sys.stdout.encoding, len(\"é\"))'"))
    assert r.output == "café.txt\n1\nutf-8 1\n", r.output


def test_prompt_marker_lookalikes_do_not_end_a_command(sandbox, run):
    r = run(sandbox.bash(r"""echo "$PS1"; printf '\x1eRDdeadbeef1:0\x1e'; echo after; (exit 7)"""))
    assert "after" in r.output
    assert r.exit_code == 7


def test_long_command_beyond_tty_line_limit(sandbox, run):
    payload = "x" * 20000
    r = run(sandbox.bash(f"s={payload}; echo ${{#s}}"))
    assert r.output == "20000\n"


def test_cwd_and_environment_persist(sandbox, run):
    run(sandbox.bash("mkdir -p /tmp/deep/er && cd /tmp/deep/er && export FOO=bar && greet() { echo hi $1; }"))
    assert run(sandbox.bash("pwd")).output == "/tmp/deep/er\n"
    assert run(sandbox.bash("echo $FOO; greet you")).output == "bar\nhi you\n"
    run(sandbox.bash("cd /workspace"))


def test_named_sessions_are_independent(sandbox, run):
    run(sandbox.bash("cd /tmp", session="other"))
    assert run(sandbox.bash("pwd", session="other")).output == "/tmp\n"
    assert run(sandbox.bash("pwd")).output == "/workspace\n"
    with pytest.raises(ExecError):
        run(sandbox.bash("true", session="bad name!"))
    run(sandbox.close_session("other"))
    assert run(sandbox.bash("pwd", session="other")).output == "/workspace\n"


def test_read_answered_by_send_input(sandbox, run):
    async def scenario():
        task = asyncio.ensure_future(sandbox.bash("read -p 'name? ' x; echo got:$x", timeout=30))
        await asyncio.sleep(0)  # let the task send its request first (requests keep their order)
        await sandbox.send_input("rollout\n")
        return await task

    r = run(scenario())
    assert "got:rollout" in r.output
    assert (r.exit_code, r.timed_out) == (0, False)


def test_send_input_without_session_is_an_exec_error(sandbox, run):
    with pytest.raises(ExecError):
        run(sandbox.send_input("x\n", session="never-started"))


def interrupted(sandbox, run, command: str, after: float = 0.0):
    """Run `command`, send an interrupt `after` s later (requests keep their order at the
    terminal, so the interrupt never overtakes the command line), and return its result."""
    async def scenario():
        task = asyncio.ensure_future(sandbox.bash(command, timeout=60))
        await asyncio.sleep(after)
        await sandbox.interrupt()
        return await task

    return run(scenario())


def test_interrupt_sleep(sandbox, run):
    r = interrupted(sandbox, run, "sleep 100")
    assert r.exit_code == 130
    assert not r.timed_out
    assert r.duration < 30
    assert run(sandbox.bash("echo still here")).output == "still here\n"


def test_a_sandbox_started_with_sigint_ignored_still_interrupts_its_commands(run):
    """A daemon started by a script's `daemon &` (or under a test runner's worker) has SIGINT ignored, and an ignored
    signal passes through fork and exec: the sandbox resets it, else every interrupt ended in SIGKILL (137)."""
    require_bwrap()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sb = run(get_runtime("bwrap").create(SandboxSpec()))
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        assert interrupted(sb, run, "sleep 100").exit_code == 130
        assert run(sb.bash("sleep 100", timeout=0.5)).exit_code == 130
    finally:
        run(sb.close())


def test_timeout_interrupts_and_session_stays_usable(sandbox, run):
    run(sandbox.bash("cd /tmp"))
    r = run(sandbox.bash("sleep 100", timeout=0.5))
    assert r.timed_out and r.exit_code == 130 and not r.session_ended
    after = run(sandbox.bash("echo ok; pwd"))
    assert after.output == "ok\n/tmp\n"  # same shell: cwd kept
    run(sandbox.bash("cd /workspace"))


def test_timeout_of_a_program_that_ignores_ctrl_c(sandbox, run):
    r = run(sandbox.bash("trap '' INT; sleep 100", session="stubborn", timeout=0.5))
    assert r.timed_out
    # the trap was set in the shell itself: the session may have been restarted, never stuck
    after = run(sandbox.bash("echo ok", session="stubborn"))
    assert after.output == "ok\n" and after.exit_code == 0


def test_output_flood_is_truncated_with_marker(sandbox, run):
    r = run(sandbox.bash("echo START; head -c 10000000 /dev/zero | tr '\\0' 'y'; echo; echo END", max_output=8192, timeout=60))
    assert r.truncated
    assert r.output.startswith("START\nyyyy")
    assert r.output.endswith("yyyy\nEND\n")
    assert "bytes truncated" in r.output
    assert len(r.output) < 8192 + 300
    assert r.exit_code == 0


def test_exit_ends_session_and_next_command_gets_a_new_one(sandbox, run):
    run(sandbox.bash("cd /tmp", session="ephemeral"))
    r = run(sandbox.bash("echo bye; exit 3", session="ephemeral"))
    assert r.exit_code == 3 and r.session_ended
    assert r.output.startswith("bye\n")
    assert run(sandbox.bash("pwd", session="ephemeral")).output == "/workspace\n"


def test_timeout_kills_what_the_command_left_in_the_background_only(sandbox, run):
    run(sandbox.bash("sleep 600 & echo $! > /tmp/earlier.pid", session="bg"))
    r = run(sandbox.bash("sleep 700 & echo $! > /tmp/mine.pid; sleep 100", session="bg", timeout=0.5))
    assert r.timed_out and not r.session_ended
    alive = run(sandbox.bash("kill -0 $(cat /tmp/earlier.pid) && echo earlier-alive; kill -0 $(cat /tmp/mine.pid) 2>/dev/null || echo mine-gone", session="bg"))
    assert alive.output.startswith("earlier-alive\nmine-gone\n")  # then bash's job notice
    run(sandbox.close_session("bg"))


def test_commands_run_when_the_command_file_directory_is_removed(sandbox, run):
    # command files live on the sandbox's /tmp (tmpfs); an agent may wipe it
    assert run(sandbox.bash("rm -rf /tmp/.rolloutd /tmp/* 2>/dev/null; echo wiped")).output == "wiped\n"
    r = run(sandbox.bash("echo again; ls -d /tmp/.rolloutd/cmd"))
    assert r.output == "again\n/tmp/.rolloutd/cmd\n" and r.exit_code == 0


def test_commands_run_when_tmp_is_full(make_sandbox, run):
    sb = make_sandbox(tmp_mb=4)
    r = run(sb.bash("cat /dev/zero > /tmp/fill; df -k /tmp | tail -1"))
    assert "No space left" in r.output, r.output
    # the command file no longer fits on /tmp: the control directory takes it
    r = run(sb.bash("test -s /.rolloutd/cmd/default.sh && echo fallback; cat <<'EOF'\nlong line " + "x" * 8000 + "\nEOF"))
    assert r.output == "fallback\nlong line " + "x" * 8000 + "\n" and r.exit_code == 0
    run(sb.bash("rm /tmp/fill"))
    assert run(sb.bash("echo freed")).output == "freed\n"


def test_timeout_kills_a_pipeline_and_the_session_stays_usable(sandbox, run):
    run(sandbox.bash("true", session="pipe", timeout=600))  # a later, shorter deadline must still fire
    r = run(sandbox.bash("sleep 100 | cat", session="pipe", timeout=0.5))
    assert r.timed_out and not r.session_ended and r.exit_code == 130
    assert r.duration < 5
    left = run(sandbox.bash("ps -o comm= -s $$", session="pipe"))  # this session's processes
    assert sorted(left.output.split()) == ["bash", "ps"], left.output
    run(sandbox.close_session("pipe"))


def test_interrupt_ends_a_loop_of_programs(sandbox, run):
    r = interrupted(sandbox, run, "for i in 1 2 3 4 5 6 7 8; do sleep 1; echo $i; done", after=0.3)
    assert (r.exit_code, r.timed_out) == (130, False)
    assert r.duration < 5 and "8" not in r.output
    assert run(sandbox.bash("echo next")).output == "next\n"


def test_closing_a_session_answers_its_running_command(sandbox, run):
    async def scenario():
        # the setsid'd sleep leaves the session but keeps the terminal open: the
        # answer cannot wait for the terminal's end
        task = asyncio.ensure_future(sandbox.bash("setsid sleep 1000 & sleep 100", session="closing", timeout=60))
        await asyncio.sleep(0.3)
        await sandbox.close_session("closing")
        return await asyncio.wait_for(task, 10)

    r = run(scenario())
    assert r.session_ended and not r.timed_out
    assert run(sandbox.bash("echo fresh", session="closing")).output == "fresh\n"
    run(sandbox.close_session("closing"))


def test_commands_sent_together_to_one_session_run_in_turn(sandbox, run):
    async def scenario():
        return await asyncio.gather(
            sandbox.bash("sleep 0.2; echo first", session="turns"),
            sandbox.bash("echo second", session="turns"),  # waits for the session
        )

    outputs = [r.output for r in run(scenario())]
    assert outputs == ["first\n", "second\n"]
    run(sandbox.close_session("turns"))


def test_timeouts_still_fire_after_thousands_of_commands(sandbox, run):
    # every command leaves a deadline entry behind (dropped when they pile up): the
    # next command's timeout must still fire
    async def many():
        for _ in range(4200):
            await sandbox.bash("true", session="many", timeout=3600)

    run(many(), timeout=300)
    r = run(sandbox.bash("sleep 100", session="many", timeout=0.5))
    assert r.timed_out and r.duration < 5
    run(sandbox.close_session("many"))
