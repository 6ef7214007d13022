"""The command lines as a new user meets them: defaults shown in help, --version, shell completion, a
pipe closed early, the no-token message, the controller saying how to reach it, and `get -o wide` on a
narrow terminal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rolloutd.controller.cli_common import installed_version


def run(module: str, *args: str, env: dict | None = None, timeout: float = 60,
        stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, input=stdin)


def test_help_keeps_the_defaults_written_in_brackets():
    out = run("rolloutd.controller.main", "controller", "--help").stdout
    assert "[default:" in out and "~/.local/share/rolloutd" in out  # rich markup used to eat '[default: …]'
    ctl = run("rolloutd.controller.ctl", "--help").stdout
    assert "$ROLLOUTD_CA_FILE" in ctl


@pytest.mark.parametrize("module", ["rolloutd.controller.main", "rolloutd.controller.ctl"])
def test_version_and_completion(module):
    done = run(module, "--version")
    assert done.returncode == 0 and done.stdout.strip() == installed_version() != "unknown"
    # typer's own switch: take the shell named here instead of looking for one among this process's parents (under
    # `make` there is one; under a detached runner there is none, and the script came out empty)
    script = run(module, "--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert script.returncode == 0 and "complete" in script.stdout


class _Trajectories(BaseHTTPRequestHandler):
    """Answers any trajectory page with as many rows as asked for: enough output to outlast a pipe."""

    def do_GET(self):  # noqa: N802 - http.server's name
        rows = "".join(json.dumps({"seq": i + 1, "reward": 1.0, "tokenIds": list(range(200))}) + "\n"
                       for i in range(1000))
        body = rows.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/jsonl")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_pipe_closed_early_ends_rolloutctl_quietly():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trajectories)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "ROLLOUTD_SERVER": f"http://127.0.0.1:{server.server_port}", "ROLLOUTD_TOKEN": "t"}
        done = subprocess.run(["bash", "-c", f"'{sys.executable}' -m rolloutd.controller.ctl trajectories job "
                               "-o jsonl | head -n 1; echo \"status ${PIPESTATUS[0]}\" >&2"],
                              capture_output=True, text=True, env=env, timeout=60)
    finally:
        server.shutdown()
    assert json.loads(done.stdout.splitlines()[0])["seq"] == 1
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr and "error" not in done.stderr
    assert "status 141" in done.stderr


def test_without_a_token_the_message_names_the_cli_flag_and_variables(tmp_path):
    env = {"ROLLOUTD_SERVER": "http://127.0.0.1:9", "ROLLOUTD_TOKEN": "", "ROLLOUTD_TOKEN_FILE": str(tmp_path / "none"),
           "ROLLOUTD_CONFIG": str(tmp_path / "no-config.yaml")}
    done = run("rolloutd.controller.ctl", "get", "rj", env=env)
    assert done.returncode == 1
    assert "--token-file" in done.stderr and "ROLLOUTD_TOKEN_FILE" in done.stderr and "token=" not in done.stderr


def test_the_controller_says_how_to_point_rolloutctl_at_it(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir",
                             str(tmp_path / "data"), "--port", "0", "--executors", "", "--no-operator"],
                            stderr=subprocess.PIPE, text=True)
    try:
        hint = ""
        for line in proc.stderr:  # the hint is logged before the server starts serving
            if "point rolloutctl" in line:
                hint = line
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert f"ROLLOUTD_TOKEN_FILE={tmp_path / 'data' / 'token'}" in hint and "ROLLOUTD_SERVER=http://127.0.0.1:" in hint


def _on_a_terminal(argv: list[str], env: dict, columns: int = 80) -> str:
    """What `argv` prints on a terminal `columns` wide (a pseudo-terminal), colours stripped."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**env, "COLUMNS": str(columns)})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", b"".join(chunks).decode()).replace("\r", "")


def test_get_wide_on_a_narrow_terminal_cuts_no_name_and_no_column(controller, example_yaml):
    name = "a-job-with-a-rather-long-name-for-a-narrow-terminal"
    env = {**os.environ, "ROLLOUTD_SERVER": controller.url, "ROLLOUTD_TOKEN": controller.token,
           "ROLLOUTD_CONFIG": str(controller.data_dir.parent / "no-config.yaml")}
    done = run("rolloutd.controller.ctl", "apply", "-f", "-", env=env, timeout=60,
               stdin=example_yaml.replace("name: math-demo", f"name: {name}"))
    assert done.returncode == 0, done.stderr
    shown = _on_a_terminal([sys.executable, "-m", "rolloutd.controller.ctl", "get", "rj", "-o", "wide"], env)
    header, row = [line for line in shown.splitlines() if line.strip()][:2]
    assert header.split() == ["NAME", "PHASE", "NODES", "SCORED", "AGENT-FAILED", "INFRA-FAILED", "TOTAL", "REWARD",
                              "AGE", "CANCELLED", "REQUESTED", "EXECUTOR", "TASKS", "MESSAGE"], shown
    assert row.split()[:3] == [name, "Pending", "0"], shown
    assert "…" not in shown
