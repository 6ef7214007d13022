"""Text helpers."""
import re
import unicodedata


def slugify(text, sep="-"):
    """Lowercase ASCII slug: accents dropped, runs of other characters become one separator.

    >>> slugify("Hello, World!")
    'hello-world'
    """
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^a-zA-Z0-9]+", sep, text.lower())
    return text.strip(sep)


def truncate(text, width, placeholder="..."):
    """Shorten `text` to at most `width` characters, ending with `placeholder` when cut."""
    if width < len(placeholder):
        raise ValueError("width must be at least the placeholder's length")
    if len(text) <= width:
        return text
    return text[: width - len(placeholder)] + placeholder


def wrap_words(text, width):
    """Greedy word wrap: a list of lines no longer than `width` (a longer word gets its own line)."""
    lines, current = [], ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines
