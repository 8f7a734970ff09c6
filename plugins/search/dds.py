"""Data Dependency Search (the RRTO paper's sequence search), as candidates for verification.

Downloads cut the search space: an inference ends by handing values to the app, so the period of
the steady state is a distance between two downloads of the same operator. For each such
period, shortest first, the periodic tail of the log is found with one vectorised comparison;
within it, block starts are limited to start candidates, calls whose tensors are all fresh
uploads, persistent tensors or values fixed before the steady state (never outputs of the
previous block). ``rrtod.search.verify`` then checks the dataflow of each candidate.
"""

from __future__ import annotations

import numpy as np

from rrtod.oplog import LoggedCall
from rrtod.search import Candidate


class DataDependencySearch:
    def __init__(self, max_periods: int = 64):
        self.max_periods = max_periods

    def candidates(self, log: list[LoggedCall]) -> list[Candidate]:
        n = len(log)
        downloads = [e.index for e in log if e.downloaded]
        if len(downloads) < 2:
            return []
        keys = np.fromiter((e.key for e in log), dtype=np.int64, count=n)
        last = downloads[-1]
        periods = sorted({last - d for d in downloads[:-1] if keys[d] == keys[last]})
        producer = {oid: e.index for e in log for oid in e.outputs}
        out: list[Candidate] = []
        for period in periods[: self.max_periods]:
            same = keys[: n - period] == keys[period:]
            breaks = np.flatnonzero(~same)
            tail = int(breaks[-1]) + 1 if len(breaks) else 0  # log[tail:] has this period
            if n - tail < 2 * period:
                continue
            for s in range(tail, tail + period):
                if self._is_start(log[s], producer, tail):
                    out.append(Candidate(s, period))
        return out

    @staticmethod
    def _is_start(e: LoggedCall, producer: dict[int, int], tail: int) -> bool:
        """Depends only on uploads, persistent tensors and values from before the steady state."""
        return all(kind != "live" or producer.get(v, -1) < tail for kind, v in e.refs)  # type: ignore[arg-type]
