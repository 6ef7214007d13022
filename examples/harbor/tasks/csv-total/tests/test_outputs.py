import json
from pathlib import Path


def test_total_file_exists():
    assert Path("/app/total.json").is_file()


def test_total_values():
    data = json.loads(Path("/app/total.json").read_text())
    assert data == {"orders": 4, "total": 50.74}
