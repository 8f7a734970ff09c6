"""Lanes: the wire's thread index, shared by app threads that take turns.

Sequences are recorded, searched for and matched per thread index (``OpCall.thread``,
``InferenceMark.thread``, ``SequenceDef.thread``): calls of threads that run at the same time
interleave on one session, and only one thread's calls show an inference whole. But an app
whose inferences run one at a time on changing threads never showed one thread an inference
twice: a ROS 2 node under a ``MultiThreadedExecutor`` (each callback on whichever pool thread
is free), a server handling each request on a thread of its own. Each pool thread learnt its
own sequence (two forwarded inferences each, one definition each on the host); a thread per
request never replayed.

So the index is a lane, not a thread. A thread that begins an inference (its outermost module
call) and holds no lane takes the lowest lane that no thread holds, or whose thread has ended
its inference since it took the lane or began that inference (``end``: its outputs read, no
replay under way). It keeps the lane until another thread takes it so. Threads that take turns
then share lane 0, and its log shows their inferences one after the other, as one thread's
would; threads that overlap hold lanes of their own, as before; a thread that runs
inferences steadily keeps its lane. A lane changes hands only between two inferences of its
threads, never inside one, so each lane's calls are one inference after the other.

A call outside an inference by a thread with no lane (a helper thread computing on an
output) takes the lowest lane no thread holds, never another's: the helper does not move a
steady thread off its lane. Such a lane is provisional: if that thread then begins an
inference while a lower lane is free or ended, it moves there. A thread that ends (its
``threading.local`` goes) gives its lane back.
"""

from __future__ import annotations

import itertools
import threading
import weakref


class _Alive:
    """Held in a thread's ``threading.local``: collected when that thread ends."""


class Lanes:
    """Which lane each app thread's calls go in (``lane``, per call), handed over between
    inferences (``begin``, ``end``). Each thread's lane is in a cell of its own (a one-item
    list in its ``threading.local``) that the lane's next holder empties: a new thread never
    inherits one, whatever ident the system gives it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._holder: dict[int, list[int | None]] = {}  # lane -> its thread's cell
        self._ended: set[int] = set()  # lanes whose thread ended its inference since
        self._gone: list[list[int | None]] = []  # cells of threads that ended
        self._provisional: set[int] = set()  # lanes taken by a call, not an inference

    def lane(self) -> int:
        """This thread's lane (one no thread holds, taken now, if it has none)."""
        cell = getattr(self._local, "cell", None)
        lane = cell[0] if cell is not None else None
        if lane is None:
            with self._lock:
                lane = self._take(ended=False)
                self._provisional.add(lane)
        return lane

    def begin(self) -> int:
        """This thread begins an inference: its lane, which no other thread takes until it
        ends it. Taken now if it has none, or if it has a provisional one and a lower lane
        is free or ended."""
        with self._lock:
            cell = getattr(self._local, "cell", None)
            lane = cell[0] if cell is not None else None
            if lane is None:
                lane = self._take(ended=True)
            elif lane in self._provisional:
                self._provisional.discard(lane)
                lower = self._lowest(ended=True)
                if lower < lane:
                    del self._holder[lane]
                    lane = self._take(ended=True)
            self._ended.discard(lane)
            return lane

    def end(self) -> None:
        """This thread's inference ended, its replay (if any) done: another thread may take
        its lane from now on."""
        with self._lock:
            cell = getattr(self._local, "cell", None)
            if cell is not None and cell[0] is not None:
                self._ended.add(cell[0])

    def held(self) -> list[int]:
        """The lanes threads hold now, lowest first."""
        with self._lock:
            self._reap()
            return sorted(self._holder)

    def _lowest(self, ended: bool) -> int:
        """(Under the lock.) The lowest lane no thread holds (or, with ``ended``, whose
        thread ended its inference)."""
        self._reap()
        return next(k for k in itertools.count()
                    if k not in self._holder or (ended and k in self._ended))

    def _take(self, ended: bool) -> int:
        """(Under the lock.) ``_lowest(ended)``, now this thread's; the thread that held it,
        if any, has none until its next call."""
        lane = self._lowest(ended)
        previous = self._holder.get(lane)
        if previous is not None:
            previous[0] = None
        cell = getattr(self._local, "cell", None)
        if cell is None:  # this thread's first lane: given back when it ends
            cell = self._local.cell = [None]
            self._local.alive = alive = _Alive()
            weakref.finalize(alive, self._gone.append, cell)
        cell[0] = lane
        self._holder[lane] = cell
        self._ended.discard(lane)
        self._provisional.discard(lane)
        return lane

    def _reap(self) -> None:
        """(Under the lock.) Give back the lanes of threads that ended."""
        while self._gone:
            cell = self._gone.pop()
            lane = cell[0]
            if lane is not None and self._holder.get(lane) is cell:
                del self._holder[lane]
                self._ended.discard(lane)
                self._provisional.discard(lane)
