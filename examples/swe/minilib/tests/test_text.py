import pytest

from minilib.text import slugify, truncate, wrap_words


def test_slugify_basic():
    assert slugify("Hello World") == "hello-world"


def test_slugify_punctuation_runs():
    assert slugify("Hello,  World!") == "hello-world"


def test_slugify_accents():
    assert slugify("Crème Brûlée") == "creme-brulee"


def test_slugify_custom_separator():
    assert slugify("a b c", sep="_") == "a_b_c"


def test_truncate_short_text_unchanged():
    assert truncate("abc", 10) == "abc"


def test_truncate_cuts_with_placeholder():
    assert truncate("abcdefghij", 6) == "abc..."
    assert len(truncate("abcdefghij", 6)) == 6


def test_truncate_width_too_small():
    with pytest.raises(ValueError):
        truncate("abcdef", 2)


def test_wrap_words():
    assert wrap_words("the quick brown fox", 10) == ["the quick", "brown fox"]


def test_wrap_words_long_word():
    assert wrap_words("a extraordinarily b", 5) == ["a", "extraordinarily", "b"]
