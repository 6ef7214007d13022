from pathlib import Path


def test_distinct_count():
    assert Path("/srv/corpus/distinct.txt").read_text().strip() == "11"
