import json
from pathlib import Path


def test_total_file_exists():
    assert Path("/app/total.json").is_file()


def test_total_values():
    data = json.loads(Path("/app/total.json").read_text())
    assert data == {"orders": 4, "total": 50.74}


def test_sqlite_agrees():
    """The image's sqlite3 (installed with apt-get) computes the same total from the CSV."""
    import subprocess

    out = subprocess.run(["sqlite3", ":memory:", "-cmd", ".mode csv", "-cmd", ".import /app/data/orders.csv o",
                          "select round(sum(amount), 2) from o"], capture_output=True, text=True, check=True).stdout
    assert float(out) == json.loads(Path("/app/total.json").read_text())["total"]
