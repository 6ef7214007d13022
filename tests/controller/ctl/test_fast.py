"""`rolloutctl get`'s fast path (controller/ctl/fast.py) against a real controller: the same output, errors and
exit codes as the full typer CLI, without importing typer, rich or httpx; everything else falls back."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from support.controller_process import ControllerProcess

# runs the installed command's entry point and then names the heavy modules it imported (on stderr, last line)
_ENTRY = ("import sys\nfrom rolloutd.controller.ctl.entry import main\nsys.argv = ['rolloutctl', *sys.argv[1:]]\n"
          "try:\n    main()\nfinally:\n    sys.stdout.flush()\n"
          "    print('HEAVY', sorted(m for m in ('typer', 'rich', 'httpx') if m in sys.modules), file=sys.stderr)\n")


def _env(controller) -> dict[str, str]:
    return {**os.environ, "ROLLOUTD_SERVER": controller.url, "ROLLOUTD_TOKEN": controller.token,
            "ROLLOUTD_CONFIG": str(controller.data_dir.parent / "no-config.yaml")}


def entry(controller, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    r = subprocess.run([sys.executable, "-c", _ENTRY, *args], capture_output=True, text=True, env=_env(controller),
                       timeout=60)
    *rest, heavy = r.stderr.splitlines() or [""]
    r.stderr = "".join(line + "\n" for line in rest)
    return r, heavy


def full(controller, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", *args], capture_output=True, text=True,
                          env=_env(controller), timeout=60, input=stdin)


def _same_table(text: str) -> list[list[str]]:
    """A table's cells with the AGE column's values blurred (the two runs may fall either side of a second)."""
    return [[re.sub(r"^\d+[smhd]$", "AGE", c) for c in line.split()] for line in text.splitlines()]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """One controller holding three jobs in two namespaces, for every comparison here (they only read)."""
    from support.example_job import example_yaml

    c = ControllerProcess(tmp_path_factory.mktemp("fast") / "data").start()
    try:
        for ns, name, team in (("default", "fast-a", "rl"), ("default", "fast-b", "other"), ("team-f", "fast-c", "rl")):
            doc = example_yaml().replace("name: math-demo", f"name: {name}").replace("team: rl", f"team: {team}")
            r = full(c, "-n", ns, "apply", "-f", "-", stdin=doc)
            assert r.returncode == 0, r.stderr
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("args", [
    ("get", "rolloutjobs"), ("get", "rj", "-o", "wide"), ("get", "rolloutjobs", "-A"), ("get", "rj", "fast-a"),
    ("-n", "team-f", "get", "rj"), ("get", "rj", "-n", "team-f", "-o", "wide"), ("get", "rj", "-l", "team=rl"),
    ("get", "rj", "-lteam=rl", "-o", "json"), ("get", "rj", "fast-a", "-o", "yaml"), ("get", "rj", "-A", "-o", "json"),
    ("--namespace=team-f", "get", "rj", "fast-c", "-o", "json"), ("get", "rj", "-l", "team=none"),
])
def test_the_fast_path_prints_what_the_full_cli_prints(jobs, args):
    fast, heavy = entry(jobs, *args)
    slow = full(jobs, *args)
    assert heavy == "HEAVY []", (args, heavy)  # answered without typer, rich or httpx
    assert (fast.returncode, fast.stderr) == (slow.returncode, slow.stderr) == (0, slow.stderr), args
    if "-o" in args and args[args.index("-o") + 1] in ("json", "yaml"):
        assert fast.stdout == slow.stdout
    elif "team=none" in args:
        assert fast.stdout == slow.stdout == "" and fast.stderr == "No resources found.\n"
    else:
        assert _same_table(fast.stdout) == _same_table(slow.stdout) and len(fast.stdout.splitlines()) > 1


@pytest.mark.parametrize("args", [
    ("get", "rj", "absent"),                       # the server's NotFound: the full path words the error
    ("get", "pods"), ("get", "rj", "-o", "table"),  # usage errors
    ("describe", "rj", "fast-a"),
])
def test_anything_else_falls_back_to_the_full_cli(jobs, args):
    fast, heavy = entry(jobs, *args)
    slow = full(jobs, *args)
    assert "typer" in heavy, (args, heavy)
    assert (fast.returncode, fast.stdout, fast.stderr) == (slow.returncode, slow.stdout, slow.stderr), args
    assert fast.returncode != 0 or args[0] == "describe"


def test_help_and_unknown_flags_reach_typer(jobs):
    helped, heavy = entry(jobs, "get", "rj", "--help")
    assert helped.returncode == 0 and "List RolloutJobs" in helped.stdout and "typer" in heavy
    unknown, heavy = entry(jobs, "get", "rj", "--watch")
    assert unknown.returncode == 2 and "--watch" in unknown.stderr and "typer" in heavy


def test_a_wrong_token_or_a_stopped_controller_is_the_full_cli_error(jobs):
    env = {**_env(jobs), "ROLLOUTD_TOKEN": "wrong"}
    r = subprocess.run([sys.executable, "-c", _ENTRY, "get", "rj"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "Unauthorized" in r.stderr and "Traceback" not in r.stderr
    env["ROLLOUTD_SERVER"] = "http://127.0.0.1:9"  # the discard port: nothing listens
    r = subprocess.run([sys.executable, "-c", _ENTRY, "get", "rj"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "cannot reach the controller" in r.stderr and "Traceback" not in r.stderr
