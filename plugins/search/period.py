"""Period detection on operator keys: an alternative sequence search to compare with ``dds``.

It ignores dataflow and downloads: the Z-function of the reversed key sequence gives, for each
period p, how far back from the end the log repeats with period p; the smallest p covering at
least two repetitions wins, proposed at every phase of one period. It is cheap and
framework-agnostic, but most of its phases cut an inference in two, which verification must
reject; the comparison counts those as false positives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from rrtod.hookspecs import Candidate
from rrtod.robot.oplog import LoggedCall


def z_function(seq: list[int]) -> list[int]:
    """z[i]: length of the longest common prefix of seq and seq[i:] (z[0] = len(seq))."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and seq[z[i]] == seq[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    return z


def tail_periods(keys: list[int], min_repeats: int = 2) -> list[tuple[int, int]]:
    """(period, tail length) for every period whose periodic tail holds ``min_repeats`` copies."""
    z = z_function(keys[::-1])
    return [(p, p + z[p]) for p in range(1, len(keys)) if p + z[p] >= min_repeats * p]


class PeriodSearch:
    def __init__(self, min_repeats: int = 2, max_periods: int = 8):
        self.min_repeats = min_repeats
        self.max_periods = max_periods

    def candidates(self, log: Sequence[LoggedCall]) -> Iterator[Candidate]:
        keys = [e.key for e in log]
        for period, tail in tail_periods(keys, self.min_repeats)[: self.max_periods]:
            start = len(keys) - tail
            yield from (Candidate(s, period) for s in range(start, start + period))
