import pytest

from minilib.calendar import days_in_month, is_leap_year


def test_leap_every_fourth_year():
    assert is_leap_year(2024)
    assert not is_leap_year(2023)


def test_century_not_leap():
    assert not is_leap_year(1900)


def test_every_400th_year_is_leap():
    assert is_leap_year(2000)
    assert is_leap_year(2400)


def test_days_in_month():
    assert days_in_month(2023, 1) == 31
    assert days_in_month(2023, 4) == 30


def test_february():
    assert days_in_month(2023, 2) == 28
    assert days_in_month(2024, 2) == 29


def test_bad_month():
    with pytest.raises(ValueError):
        days_in_month(2023, 13)
