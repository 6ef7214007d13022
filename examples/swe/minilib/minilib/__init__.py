"""minilib: small text, statistics, sequence and calendar helpers."""
from .calendar import days_in_month, is_leap_year
from .sequences import chunk, dedupe, window
from .stats import clamp, mean, median
from .text import slugify, truncate, wrap_words

__all__ = [
    "chunk", "clamp", "days_in_month", "dedupe", "is_leap_year", "mean", "median",
    "slugify", "truncate", "window", "wrap_words",
]
__version__ = "0.3.0"
