"""`ControllerProcess`: a real `rolloutd controller` process on a free port, with a data dir of its own:
start, stop (SIGTERM or SIGKILL), restart on the same data, an authenticated client; `ctl`: rolloutctl against it.
The fixtures of tests/controller, tests/controller/kube (over https: support/kube_controller.py), tests/tenancy and
tests/ui start it.
Next step: one start-up wait shared with support/cluster.py (the e2e controller)."""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from support.ports import free_port

# a loaded box (load 25+) has taken 30-44 s to start one; a healthy start returns as soon as /healthz answers
START_SECONDS = 90


def ctl(controller: ControllerProcess, *args: str, stdin: str | None = None, env: dict | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """`rolloutctl ARGS` (the full typer app, `python -m rolloutd.controller.ctl`) against `controller`, with its
    token and no config file; for tests/controller/ctl and tests/controller/test_trust.py."""
    e = {**os.environ, "ROLLOUTD_SERVER": controller.url, "ROLLOUTD_TOKEN": controller.token,
         "ROLLOUTD_CONFIG": str(controller.data_dir.parent / "no-config.yaml"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", *args], input=stdin,
                          capture_output=True, text=True, env=e, timeout=timeout)


class ControllerProcess:
    """`rolloutd controller` as a subprocess: start, stop (SIGTERM or SIGKILL), restart on the same data."""

    def __init__(self, data_dir: Path, executors: str = "", extra_args: tuple[str, ...] = (), scheme: str = "http",
                 verify: str | bool = True, env: dict[str, str] | None = None, nofile: int | None = None):
        self.data_dir = data_dir
        self.nofile = nofile  # the process's file-descriptor limit (soft and hard), when set
        self.env = env  # added to this process's environment (its ROLLOUTD_* settings)
        self.executors = executors
        # https: extra_args name the certificate, `verify` is the CA file that signed it
        self.extra_args, self.scheme, self.verify = extra_args, scheme, verify
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.data_dir / "token").read_text().strip()

    def start(self) -> "ControllerProcess":
        log = open(self.data_dir.parent / f"controller-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(self.data_dir),
             "--port", str(self.port), "--log-level", "warning", "--executors", self.executors, *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **self.env} if self.env else None,
            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile)))
            if self.nofile else None,
        )
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited with {self.proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1, verify=self.verify).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop(signal.SIGKILL)  # not left running behind the failed test (leaked ones loaded the box further)
        raise RuntimeError(f"controller did not become healthy within {START_SECONDS} s; see {log.name}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        self.stop(sig)
        self.start()

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, verify=self.verify,
                            headers={"Authorization": f"Bearer {token or self.token}"})
