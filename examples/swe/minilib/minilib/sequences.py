"""Helpers over sequences and iterables."""


def chunk(items, size):
    """Split `items` into lists of `size` elements; the last one may be shorter."""
    if size < 1:
        raise ValueError("size must be positive")
    items = list(items)
    return [items[i : i + size] for i in range(0, len(items), size)]


def dedupe(items, key=None):
    """Items in their original order, each distinct one (by `key`, if given) kept once."""
    seen = set()
    out = []
    for item in items:
        marker = item if key is None else key(item)
        if marker not in seen:
            seen.add(marker)
            out.append(item)
    return out


def window(items, size):
    """Sliding windows of `size` consecutive items, as tuples."""
    items = list(items)
    if size < 1:
        raise ValueError("size must be positive")
    return [tuple(items[i : i + size]) for i in range(len(items) - size + 1)]
