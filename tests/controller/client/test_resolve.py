"""Where the client finds the controller and its token (the same rules as rolloutctl)."""
from __future__ import annotations

import pytest

from rolloutd.client import RolloutdError, resolve


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in ("ROLLOUTD_SERVER", "ROLLOUTD_TOKEN", "ROLLOUTD_TOKEN_FILE", "ROLLOUTD_NAMESPACE", "ROLLOUTD_CA_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ROLLOUTD_CONFIG", str(tmp_path / "none.yaml"))
    monkeypatch.setenv("ROLLOUTD_DATA_DIR", str(tmp_path / "data"))


def test_arguments_win_over_environment_and_config(monkeypatch, tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("server: http://from-config:1\ntoken: cfg-token\n")
    monkeypatch.setenv("ROLLOUTD_CONFIG", str(cfg))
    assert resolve() == resolve("http://from-config:1", token="cfg-token")
    monkeypatch.setenv("ROLLOUTD_SERVER", "http://from-env:2/")
    monkeypatch.setenv("ROLLOUTD_TOKEN", "env-token")
    c = resolve()
    assert (c.server, c.token) == ("http://from-env:2", "env-token")
    tf = tmp_path / "tok"
    tf.write_text("file-token\n")
    c = resolve("http://arg:3", token_file=tf)
    assert (c.server, c.token) == ("http://arg:3", "file-token")   # an explicit file beats ROLLOUTD_TOKEN
    assert resolve(token="arg-token").token == "arg-token"


def test_token_file_from_environment_then_the_local_data_dir(monkeypatch, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "token").write_text("local\n")
    c = resolve()
    assert (c.server, c.token) == ("http://127.0.0.1:7350", "local")
    (tmp_path / "t2").write_text("env-file")
    monkeypatch.setenv("ROLLOUTD_TOKEN_FILE", str(tmp_path / "t2"))
    assert resolve().token == "env-file"


def test_no_token_anywhere_says_where_to_put_one():
    with pytest.raises(RolloutdError, match="ROLLOUTD_TOKEN"):
        resolve()


def test_namespace_from_argument_environment_config_else_default(monkeypatch, tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("token: t\nnamespace: from-config\n")
    monkeypatch.setenv("ROLLOUTD_CONFIG", str(cfg))
    assert resolve().namespace == "from-config"
    monkeypatch.setenv("ROLLOUTD_NAMESPACE", "from-env")
    assert resolve().namespace == "from-env" and resolve(namespace="arg").namespace == "arg"
    monkeypatch.delenv("ROLLOUTD_NAMESPACE")
    cfg.write_text("token: t\n")
    assert resolve().namespace == "default"


def test_ca_file_from_environment_then_config_and_a_bad_one_is_a_clear_error(monkeypatch, tmp_path):
    from rolloutd.client import RolloutClient

    cfg = tmp_path / "config.yaml"
    cfg.write_text("token: t\ncaFile: ~/ca.pem\n")
    monkeypatch.setenv("ROLLOUTD_CONFIG", str(cfg))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve().ca_file == str(tmp_path / "ca.pem")
    monkeypatch.setenv("ROLLOUTD_CA_FILE", str(tmp_path / "env-ca.pem"))
    assert resolve().ca_file == str(tmp_path / "env-ca.pem")
    assert resolve("https://x:1", token="t").ca_file == str(tmp_path / "env-ca.pem")
    assert resolve(token="t", ca_file=tmp_path / "arg.pem").ca_file == str(tmp_path / "arg.pem")  # the argument wins
    with pytest.raises(RolloutdError, match="env-ca.pem.*cannot use it"):  # absent: said at once, no traceback
        RolloutClient("https://127.0.0.1:9", token="t")
