import pytest

from minilib.stats import clamp, mean, median


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_median_empty():
    with pytest.raises(ValueError):
        median([])


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_below_and_above():
    assert clamp(-3, 0, 10) == 0
    assert clamp(42, 0, 10) == 10


def test_clamp_bad_interval():
    with pytest.raises(ValueError):
        clamp(1, 5, 0)
