"""A job page's stage percentiles and histograms come from `_Times` (sorted blocks plus a tail of newer ones, merged
now and then) instead of sorting every time at each view: they must be exactly what the whole sorted list gives,
with ties, at every size, across many blocks and between merges. Checked against the plain definition on random
times (blocks made small here, so that the test goes through dozens of them)."""
from __future__ import annotations

import math
import random

from rolloutd.controller.work import stage_times as stats


def _plain_pct(xs: list[float], q: float) -> float:
    return round(xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))], 4)


def test_percentiles_and_histograms_match_the_whole_sorted_list(monkeypatch):
    monkeypatch.setattr(stats, "BLOCK", 3000)
    monkeypatch.setattr(stats, "MERGE_MIN", 400)
    rng = random.Random(27)
    times, every = stats.Times(), []
    merged = 0
    for step in range(150):
        for _ in range(rng.choice([1, 7, 150, 2000])):
            x = round(rng.lognormvariate(0, 1), 2) if rng.random() < 0.8 else 1.0  # ties, and many equal times
            times.append(x)
            every.append(x)
        before = [len(b) for b in times.blocks]
        times.settle()
        merged += [len(b) for b in times.blocks] != before
        whole = sorted(every)
        for q in (0.0, 0.01, 0.5, 0.95, 0.99, 1.0):
            assert stats.percentile(times, q) == _plain_pct(whole, q), (step, q)
        assert times.kth(0) == whole[0] and times.kth(len(whole) - 1) == whole[-1]
        if step % 15:
            continue
        histogram = stats.histogram(times)
        assert sum(b["n"] for b in histogram) == len(whole)
        lo, hi = whole[0], _plain_pct(whole, 0.99) or whole[0]
        width = (hi - lo) / 12 or 1.0
        for k, b in enumerate(histogram[:-1]):
            top = lo + (k + 1) * width
            assert b["n"] == sum(1 for x in whole if (k == 0 or x > lo + k * width) and x <= top), (step, k)
    assert merged > 20 and len(times.blocks) > 10 and times.tail, "merges, many blocks, and the end between two"
    assert max(map(len, times.blocks)) <= 3000


def test_empty_and_single():
    times = stats.Times()
    assert stats.percentile(times, 0.5) is None and stats.histogram(times) == []
    times.append(3.0)
    times.settle()
    assert stats.percentile(times, 0.5) == 3.0 and stats.histogram(times)[0]["n"] == 1


def test_negative_and_equal_times_keep_their_order():
    times, every = stats.Times(), [-2.5, -0.0, 0.0, 1e-300, -1e-300, 7.0, -7.0, 7.0, 3.25]
    for x in every[:5]:
        times.append(x)
    times.settle()
    times.blocks.append(sorted(every[5:]))  # a second block, as a long job has
    whole = sorted(every)
    assert [times.kth(k) for k in range(len(whole))] == whole
