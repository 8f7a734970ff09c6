"""Sequence search results, and their verification.

A search plugin proposes candidates, ``(start, period)`` positions in one thread's op log; it is
never trusted. ``verify`` accepts a candidate only when the log shows the block
``[start, start+period)`` repeated at least twice with identical operators and an identical,
closed dataflow: every tensor an op reads is an upload (an input of the inference), a persistent
tensor, an output of an earlier op of the same block at the same relative position, or one fixed
tensor produced before the steady state (a constant, such as a grid built on the first call).
Anything else, such as a value carried from one inference into the next, rejects the candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rrtod.oplog import LoggedCall

# (op position in block, ref position in op) -> where the tensor comes from
Source = tuple[str, object]


@dataclass(frozen=True)
class Candidate:
    start: int
    period: int


@dataclass
class Found:
    """A verified inference operator sequence (positions are indices into the searched log)."""

    start: int
    period: int
    repeats: int  # full repetitions seen in the log
    sources: dict[tuple[int, int], Source]  # every tensor input of every op of the block
    inputs: list[tuple[int, int]]  # (op, ref) positions that are uploads
    outputs: list[tuple[int, int]]  # (op, output index) values the app downloads
    keys: list[int] = field(default_factory=list)

    @property
    def found_at(self) -> int:
        """Inferences seen when found: the steady-state repetitions plus the prefix's one."""
        return self.repeats + (1 if self.start else 0)


class SequenceSearch(Protocol):
    def candidates(self, log: list[LoggedCall]) -> list[Candidate]: ...


def verify(log: list[LoggedCall], cand: Candidate, min_repeats: int = 2) -> Found | None:
    s, period = cand.start, cand.period
    if period <= 0 or s < 0:
        return None
    repeats = (len(log) - s) // period
    if repeats < min_repeats:
        return None
    where: dict[int, tuple[int, int]] = {}  # output id -> (log position, output index)
    for e in log[: s + repeats * period]:
        for k, oid in enumerate(e.outputs):
            where[oid] = (e.index, k)
        for k, (kind, value) in enumerate(e.refs):
            if kind == "upload" and value:  # an upload bound to an id, read again later by id
                where[value] = (e.index, -(k + 1))  # type: ignore[index]
    sources: dict[tuple[int, int], Source] = {}
    outputs: set[tuple[int, int]] = set()
    for r in range(repeats):
        base = s + r * period
        for i in range(period):
            e, first = log[base + i], log[s + i]
            if e.key != first.key or len(e.refs) != len(first.refs):
                return None
            for k, (kind, value) in enumerate(e.refs):
                if kind == "live":
                    pos, out = where.get(value, (-1, -1))  # type: ignore[arg-type]
                    if base <= pos < base + i:
                        src: Source = ("produced", (pos - base, out))
                    elif pos < s:
                        src = ("constant", value)  # fixed tensor from before the steady state
                    else:
                        return None  # carried across inferences, or unknown: not replayable
                elif kind == "upload":
                    src = ("input", None)
                else:
                    src = ("persistent", value)
                if r == 0:
                    sources[(i, k)] = src
                elif sources[(i, k)] != src:
                    return None
            for oid in e.downloads:
                outputs.add((i, e.outputs.index(oid)))
    if not outputs:
        return None  # an inference returns something to the app
    inputs = [pos for pos, src in sources.items() if src[0] == "input"]
    return Found(s, period, repeats, sources, sorted(inputs), sorted(outputs),
                 [e.key for e in log[s : s + period]])


def best(log: list[LoggedCall], search: SequenceSearch, min_repeats: int = 2) -> tuple[Found | None, int]:
    """The first verified candidate, and how many candidates verification rejected."""
    rejected = 0
    for cand in search.candidates(log):
        found = verify(log, cand, min_repeats)
        if found is not None:
            return found, rejected
        rejected += 1
    return None, rejected
