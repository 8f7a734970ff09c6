"""Data Dependency Search (the RRTO paper's sequence search), as candidates for verification.

Downloads cut the search space: an inference ends by handing values to the app, so the period of
the steady state is a distance between two downloads of the same operator. An app may download
nothing in its steady state (a detector that found nothing, whose app reads only the count it
was answered): calls whose shapes the app waited for (answered ``nonzero``) after the log's last
download anchor periods the same way; only after it, so that a model with downloads keeps the
periods it had (its answered calls would add many short ones). For each such
period, shortest first, the periodic tail of the log is found with one vectorised comparison;
within it, block starts are limited to start candidates, calls whose tensors are all fresh
uploads, persistent tensors or values that existed before the steady state (never values the
previous block wrote). Starts right after a download (where an app begins its next inference)
are proposed first, then the same starts in the last two blocks (the tail's keys may repeat
across a change of weights, where its dataflow does not). Candidates are yielded lazily:
``rrtod.robot.search.search_log`` stops at the first one that ``rrtod.robot.search.verify``
accepts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from rrtod.hookspecs import Candidate
from rrtod.robot.oplog import LoggedCall, resolve_reads


class DataDependencySearch:
    def __init__(self, max_periods: int = 64):
        self.max_periods = max_periods

    def candidates(self, log: Sequence[LoggedCall]) -> Iterator[Candidate]:
        n = len(log)
        downloads = [i for i, e in enumerate(log) if e.downloaded]
        after = downloads[-1] + 1 if downloads else 0
        answered = [i for i in range(after, n) if log[i].result is not None]
        if len(downloads) < 2 and len(answered) < 2:
            return
        keys = np.fromiter((e.key for e in log), dtype=np.int64, count=n)
        found: set[int] = set()
        for anchors in (downloads, answered):
            if len(anchors) >= 2:
                last = anchors[-1]
                found.update(last - d for d in anchors[:-1] if keys[d] == keys[last])
        periods = sorted(found)
        if any(len(e.reads) != len(e.refs) for e in log[:1]):
            resolve_reads(log)
        boundary = [e.after_fetch for e in log]
        for period in periods[: self.max_periods]:
            if n < 2 * period:
                break
            same = keys[: n - period] == keys[period:]
            breaks = np.flatnonzero(~same)
            tail = int(breaks[-1]) + 1 if len(breaks) else 0  # log[tail:] has this period
            if n - tail < 2 * period:
                continue
            # A start reads nothing the previous block wrote, except values older than the
            # steady state written in place.
            starts = [s for s in range(tail, tail + period)
                      if all(latest < tail or first < tail for latest, _, first in log[s].reads)]
            yield from (Candidate(s, period) for s in starts if boundary[s])
            yield from (Candidate(s, period) for s in starts if not boundary[s])
            # Keys can repeat where the dataflow does not: the same network run with other
            # weights (a fresh model loaded from a state dict, a copy, ``.half().float()``)
            # has the same operator keys, so the periodic tail starts before the change. The
            # last two blocks are the steady state if there is one: propose them too.
            late = [s + period * ((n - s) // period - 2) for s in starts]
            yield from (Candidate(s, period) for s in late if s >= tail + period and boundary[s])
            yield from (Candidate(s, period) for s in late
                        if s >= tail + period and not boundary[s])

