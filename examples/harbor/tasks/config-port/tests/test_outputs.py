from pathlib import Path


def test_port_changed():
    lines = Path("/opt/webapp-work/app.ini").read_text().splitlines()
    assert lines == ["[server]", "host = 0.0.0.0", "port = 9090", "workers = 2"]


def test_original_untouched():
    assert "port = 8080" in Path("/etc/webapp/app.ini").read_text()
