"""`make demo`: start a controller on the embedded default, apply examples/math-demo.yaml, show it.

Uses a data dir inside the checkout (`.rolloutd/`), so it never touches another controller's
state; a second run reuses it (the apply then reports `unchanged`).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / ".rolloutd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    port = int(os.environ.get("ROLLOUTD_DEMO_PORT") or free_port())
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "ROLLOUTD_SERVER": url, "ROLLOUTD_TOKEN_FILE": str(DATA / "token"), "ROLLOUTD_TOKEN": ""}
    bindir = Path(sys.executable).parent
    log = open(REPO / ".rolloutd-controller.log", "ab")
    ctl = subprocess.Popen([str(bindir / "rolloutd"), "controller", "--data-dir", str(DATA), "--port", str(port)],
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            print("controller did not start; see .rolloutd-controller.log", file=sys.stderr)
            return 1
        print(f"controller up at {url} (data dir {DATA})\n")

        def run(*args: str) -> None:
            print("$ rolloutctl " + " ".join(args))
            subprocess.run([str(bindir / "rolloutctl"), *args], env=env, check=True)
            print()

        run("apply", "-f", str(REPO / "examples" / "math-demo.yaml"))
        run("get", "rolloutjobs", "-o", "wide")
        run("describe", "rolloutjob", "math-demo")
        return 0
    finally:
        ctl.terminate()
        ctl.wait(10)


if __name__ == "__main__":
    sys.exit(main())
