"""A stage's times (queue, INIT, RUN, EVAL) for a job page: exact percentiles and a histogram, kept up to date in
bounded steps of the event loop however long the job.

Used by `work/stats.JobStats` (one `Times` per stage per job); next step: the page's per-node throughput.
"""
from __future__ import annotations

import bisect
import math
import struct

MERGE_MIN = 4096  # new stage times kept apart (sorted at each view) before they join a block (`Times`), at the least
# stage times in one sorted block at most: a step merges at most this many, a bounded slice of the loop (measured:
# the benchmarks page, "Constants")
BLOCK = 32768


def _key(x: float) -> int:
    """An integer in the order of the floats (IEEE 754 bit patterns, the negative ones reversed)."""
    bits = struct.unpack("<q", struct.pack("<d", x))[0]
    return bits if bits >= 0 else -(bits & 0x7FFF_FFFF_FFFF_FFFF)


def _unkey(key: int) -> float:
    bits = key if key >= 0 else (-key) | -0x8000_0000_0000_0000
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class Times:
    """One stage's times, for exact percentiles and a histogram without sorting all of them at every view.

    Sorted blocks of at most BLOCK times, and a tail of the newer ones. At each view (`settle`) the tail is sorted;
    once it outgrows MERGE_MIN and an eighth of the last block, it is merged into that block, or starts a new one
    when the block would pass BLOCK. So no step sorts more than ~BLOCK times however long the job: sorting every
    time at every view (as before) took ~1 ms a stage at 200 000 rollouts and grew with the job, and one sorted
    list would take a merge of 9 ms at 400 000. The k-th smallest time is the smallest time whose rank reaches
    k + 1: bisected over the floats' bit patterns (at most 64 counts, a `bisect` per block each)."""

    __slots__ = ("blocks", "tail", "total")

    def __init__(self) -> None:
        self.blocks: list[list[float]] = []
        self.tail: list[float] = []
        self.total = 0.0  # the times' sum: the job's time split across stages

    def append(self, x: float) -> None:
        self.tail.append(x)
        self.total += x

    def __len__(self) -> int:
        return sum(map(len, self.blocks)) + len(self.tail)

    def settle(self) -> None:
        self.tail.sort()
        last = self.blocks[-1] if self.blocks else []
        if len(self.tail) < max(MERGE_MIN, len(last) // 8):
            return
        if self.blocks and len(last) + len(self.tail) <= BLOCK:
            last += self.tail
            last.sort()  # two sorted runs: timsort merges them
        else:
            self.blocks.append(self.tail)
        self.tail = []

    def _lists(self) -> list[list[float]]:
        return [xs for xs in (*self.blocks, self.tail) if xs]

    def at_most(self, x: float) -> int:
        return sum(bisect.bisect_right(xs, x) for xs in self._lists())

    def kth(self, k: int) -> float:
        """The k-th smallest time (from 0), settled."""
        lists = self._lists()
        if len(lists) == 1:
            return lists[0][k]
        lo, hi = _key(min(xs[0] for xs in lists)), _key(max(xs[-1] for xs in lists))
        while lo < hi:
            mid = (lo + hi) // 2
            x = _unkey(mid)
            if sum(bisect.bisect_right(xs, x) for xs in lists) >= k + 1:
                hi = mid
            else:
                lo = mid + 1
        return _unkey(lo)


def histogram(xs: Times, bins: int = 12) -> list[dict[str, float]]:
    """Counts in `bins` equal bins from the smallest value to the 99th percentile (the last bin takes the tail)."""
    if not len(xs):
        return []
    lo = xs.kth(0)
    hi = percentile(xs, 0.99) or lo
    width = (hi - lo) / bins or 1.0
    edges = [lo + k * width for k in range(1, bins)]
    cuts = [0, *(xs.at_most(e) for e in edges), len(xs)]
    return [{"lo": round(lo + k * width, 4), "n": cuts[k + 1] - cuts[k]} for k in range(bins)]


def percentile(xs: Times, q: float) -> float | None:
    n = len(xs)
    if not n:
        return None
    return round(xs.kth(min(n - 1, max(0, math.ceil(q * n) - 1))), 4)
