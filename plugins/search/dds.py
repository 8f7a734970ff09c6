"""Data Dependency Search (the RRTO paper's sequence search), as candidates for verification.

Downloads cut the search space: an inference ends by handing values to the app, so the period of
the steady state is a distance between two downloads of the same operator. For each such
period, shortest first, the periodic tail of the log is found with one vectorised comparison;
within it, block starts are limited to start candidates, calls whose tensors are all fresh
uploads, persistent tensors or values that existed before the steady state (never values the
previous block wrote). Starts right after a download (where an app begins its next inference)
are proposed first. Candidates are yielded lazily: ``rrtod.search.search_log`` stops at the
first one that ``rrtod.search.verify`` accepts.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from rrtod.oplog import LoggedCall
from rrtod.search import Candidate


class DataDependencySearch:
    def __init__(self, max_periods: int = 64):
        self.max_periods = max_periods

    def candidates(self, log: list[LoggedCall]) -> Iterator[Candidate]:
        n = len(log)
        downloads = [i for i, e in enumerate(log) if e.downloaded]
        if len(downloads) < 2:
            return
        keys = np.fromiter((e.key for e in log), dtype=np.int64, count=n)
        last = downloads[-1]
        periods = sorted({last - d for d in downloads[:-1] if keys[d] == keys[last]})
        reads = _reads(log)
        boundary = [e.after_fetch for e in log]
        for period in periods[: self.max_periods]:
            if n < 2 * period:
                break
            same = keys[: n - period] == keys[period:]
            breaks = np.flatnonzero(~same)
            tail = int(breaks[-1]) + 1 if len(breaks) else 0  # log[tail:] has this period
            if n - tail < 2 * period:
                continue
            starts = [s for s in range(tail, tail + period)
                      if all(latest < tail or first < tail for first, latest in reads[s])]
            yield from (Candidate(s, period) for s in starts if boundary[s])
            yield from (Candidate(s, period) for s in starts if not boundary[s])


def _reads(log: list[LoggedCall]) -> list[list[tuple[int, int]]]:
    """Per call, for each value it reads by id: (position of the value's first write, position
    of its latest write before this call); -1 when written before the log began. A start reads
    nothing the previous block wrote, except values older than it written in place."""
    first: dict[object, int] = {}
    latest: dict[object, int] = {}
    out: list[list[tuple[int, int]]] = []
    for i, e in enumerate(log):
        out.append([(first.get(v, -1), latest.get(v, -1)) for kind, v in e.refs if kind == "live"])
        written = [v for kind, v in e.refs if kind == "upload" and v]
        for v in (*written, *e.outputs):
            first.setdefault(v, i)
            latest[v] = i
    return out
