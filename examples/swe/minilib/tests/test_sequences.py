import pytest

from minilib.sequences import chunk, dedupe, window


def test_chunk_even():
    assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_chunk_keeps_remainder():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_chunk_bad_size():
    with pytest.raises(ValueError):
        chunk([1], 0)


def test_dedupe_keeps_order():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]


def test_dedupe_with_key():
    assert dedupe(["a", "A", "b"], key=str.lower) == ["a", "b"]


def test_window():
    assert window([1, 2, 3, 4], 3) == [(1, 2, 3), (2, 3, 4)]


def test_window_too_large():
    assert window([1, 2], 3) == []
