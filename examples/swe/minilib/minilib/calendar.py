"""Gregorian calendar arithmetic."""

_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap_year(year):
    """Gregorian rule: every 4th year, except centuries, except every 400th year."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    """Number of days in `month` (1-12) of `year`."""
    if not 1 <= month <= 12:
        raise ValueError("month must be in 1..12")
    if month == 2 and is_leap_year(year):
        return 29
    return _DAYS[month - 1]
