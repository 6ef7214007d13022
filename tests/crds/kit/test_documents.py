"""A file of specs (`rolloutctl apply -f`, the Python client's `apply`) that JSON or YAML parses but Python cannot
read back is a ValueError naming the file, as malformed text is: it was a bare ValueError or a RecursionError."""
from __future__ import annotations

import pytest

from rolloutd.crds.kit.documents import load_documents

DIGITS = "1" * 5000


@pytest.mark.parametrize("text, why", [
    ('{"a": %s}' % DIGITS, "a value cannot be read: Exceeds the limit (4300 digits)"),
    ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
    (f"a: {DIGITS}\n", "a value cannot be read: Exceeds the limit (4300 digits)"),
    ("a: 2026-02-30\n", "a value cannot be read: day is out of range for month"),
    ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests too deeply"),
])
def test_text_python_cannot_read_back_is_a_value_error_naming_the_file(text, why):
    with pytest.raises(ValueError) as e:
        load_documents(text, "job.yaml")
    assert type(e.value) is ValueError and str(e.value).startswith(f"job.yaml: {why}"), str(e.value)
