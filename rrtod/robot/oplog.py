"""The op log: what one app session executed, per thread, as seen by the robot daemon's relay.

Recording on the relay's path must cost next to nothing, so ``record`` only appends the parsed
frame; turning calls into comparable entries (``LoggedCall``: operator key, dataflow refs,
downloads) happens later, in ``entries()``, off the critical path, when a sequence search runs.

Dataflow refs name where each tensor input came from:
- ``("upload", id)``: host data sent with this call (fresh every inference: an input);
- ``("persistent", hash)``: a weight or buffer, by content hash;
- ``("live", id)``: a tensor already on the host, produced by an earlier call (or uploaded
  earlier). ``LoggedCall.reads`` resolves it to the latest write of that id before the call
  (an in-place op returns the id it wrote, so an id may be written several times).

Two keys per call. ``exact`` pins everything: operator, non-tensor arguments and the metadata
of every tensor argument. ``loose`` forgets integers and tensor shapes (it keeps dtypes and
ranks): the calls of a model whose shapes follow its data (a detector's count of boxes) repeat
under loose keys only. ``key`` is the one a search compares (``with_loose_keys``); verification
then explains every difference of exact keys, or refuses the candidate.

A call whose outputs' shapes depend on data is forwarded with ``want_meta``: the host picks its
output ids and sends back their metadata. The relay logs those replies (``record_result``), so
such a call has outputs in the log like any other.

The log is bounded (``max_calls``): when full, the older half is dropped and the recent steady
state kept. Entries are built incrementally (a search after more frames only parses the new
calls) from snapshots of the lists, so the relay may keep appending meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rrto.v1 import ops_pb2
from rrtod.wire import iter_tensor_refs, scalar_of

Ref = tuple[str, Any]
# For a live ref: (position of the latest write before the call, output index of that write or
# -(k+1) for an upload bound by its ref k, position of the id's first write); -1: not in the log.
Read = tuple[int, int, int]
NO_READ: Read = (-1, -1, -1)
# Seqs from here on are those of calls rebuilt from an aborted replay whose host answers are
# their replies (``Recorder.observe_replayed``); an app's forwarded calls count from 1.
REBUILT_SEQS = 1 << 62
# The last calls of a snapshot whose ``want_meta`` reply may still be on its way.
PENDING_REPLIES = 64
# Values read (and fetches awaiting their reply) kept for the search: a detector's loop reads
# a few per box.
MAX_VALUES = 16384
# Inference marks kept (``OpLog.mark``); past this the older half goes (a rebuild of entries).
MAX_MARKS = 4096


@dataclass(slots=True)
class LoggedCall:
    index: int  # position in its thread's log
    seq: int
    op: str
    key: int  # the key a search compares: ``exact`` or ``loose``
    refs: tuple[Ref, ...]
    outputs: tuple[int, ...]
    downloads: list[int] = field(default_factory=list)  # output ids the app fetched
    after_fetch: bool = False  # the first call logged after a fetch: where inferences start
    raw: ops_pb2.OpCall | None = field(default=None, repr=False)  # the recorded frame
    reads: tuple[Read, ...] = ()  # per ref, where a live one was written (see ``Read``)
    exact: int = 0  # same operator, non-tensor arguments, input metadata and grad mode
    loose: int = 0  # the same without integers and shapes (module docstring)
    result: ops_pb2.OpResult | None = field(default=None, repr=False)  # a ``want_meta`` reply
    # output id -> the value the app read of it (a one-element download, ``item()``)
    values: dict[int, int | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.exact:  # made by hand with one key: it is both
            self.exact = self.loose = self.key

    def out_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the outputs, as predicted by the app or replied by the host."""
        metas = self.result.outs if self.result is not None else (
            self.raw.out_meta if self.raw is not None else ())
        return [tuple(m.shape) for m in metas]

    @property
    def downloaded(self) -> bool:
        return bool(self.downloads)


def _meta_key(meta: ops_pb2.TensorMeta) -> bytes:
    # Equal metadata, equal bytes (TensorMeta has no map field); 3x faster than a tuple.
    return meta.SerializeToString()


@dataclass
class _Built:
    """Entries built so far for one thread filter, and the state to extend them."""

    generation: int
    calls: int = 0  # calls of the log consumed
    fetches: int = 0  # fetches attributed
    after_fetch: bool = False
    out: list[LoggedCall] = field(default_factory=list)
    metas: dict[int, bytes] = field(default_factory=dict)
    ranks: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (dtype, rank)
    writes: _Writes = field(default_factory=lambda: _Writes())
    # downloads whose value (if one-element) may not be back yet: (entry, id)
    unread: list[tuple[LoggedCall, int]] = field(default_factory=list)
    marks: int = 0  # inference marks consumed
    starts: list[int] = field(default_factory=list)  # entry positions where inferences start


class _Writes:
    """Who wrote each id so far, in log order."""

    __slots__ = ("first", "latest", "producer")

    def __init__(self) -> None:
        self.latest: dict[Any, tuple[int, int]] = {}
        self.first: dict[Any, int] = {}
        self.producer: dict[Any, LoggedCall] = {}  # latest call that returned the id

    def add(self, e: LoggedCall) -> None:
        """Resolve ``e``'s reads, then note what it writes."""
        e.reads = tuple((*self.latest.get(v, (-1, -1)), self.first.get(v, -1))
                        if kind == "live" else NO_READ for kind, v in e.refs)
        for k, (kind, v) in enumerate(e.refs):
            if kind == "upload" and v:
                self.latest[v] = (e.index, -(k + 1))
                self.first.setdefault(v, e.index)
        for k, oid in enumerate(e.outputs):
            self.latest[oid] = (e.index, k)
            self.first.setdefault(oid, e.index)
            self.producer[oid] = e


def resolve_reads(log: list[LoggedCall]) -> None:
    """Fill ``reads`` of entries made by hand (``OpLog.entries`` fills them as it builds)."""
    writes = _Writes()
    for i, e in enumerate(log):
        e.index = i
        writes.add(e)


class OpLog:
    """Bounded log of one session. Calls are kept as the frames the relay parsed anyway."""

    def __init__(self, max_calls: int = 50_000):
        self.max_calls = max_calls
        self.calls: list[ops_pb2.OpCall] = []
        self.fetched: list[int] = []  # store ids, in fetch order
        self.fetch_after: list[int] = []  # number of calls logged when each fetch arrived
        self.truncated = 0  # calls dropped from the front since the last clear
        self.recorded = 0  # calls and fetches logged since the last clear (never decreases)
        # Store id -> content hash of persistent tensors bound by dropped calls (truncation), so
        # that a weight bound long ago is still known as persistent.
        self.persistent_ids: dict[int, bytes] = {}
        self.generation = 0  # bumped when calls are dropped: built entries are then stale
        self.cleared = 0  # how many times ``clear`` emptied the log
        self.results: dict[int, ops_pb2.OpResult] = {}  # call seq -> its ``want_meta`` reply
        # Values the app read of one-element tensors (store id -> value), for integer arguments
        # it computes from them (``rrtod.robot.shapes``); the fetches still unanswered.
        self.values: dict[int, int | float] = {}
        # Downloads rebuilt from an aborted replay's pushes: no inference boundary (``insert``).
        self.quiet: set[int] = set()
        # Where the app's inferences start, as its shim marks them: (calls logged, thread).
        self.marks: list[tuple[int, int]] = []
        self._threads: set[int] = set()  # ``threads``, kept as calls are logged
        self._fetching: dict[int, int] = {}  # fetch seq -> store id
        # A reply the relay saw before the fetch it answers (it logs frames once written up).
        self._early: dict[int, int | float] = {}  # fetch seq -> value
        self._built: dict[int | None, _Built] = {}
        # ``insert`` changes the lists in the middle: a snapshot (``entries``) must not see half
        # of it. (Appends and truncation keep the generation protocol: the relay's thread.)
        self._insert_lock = threading.Lock()

    def record(self, frame: ops_pb2.SessionUp) -> None:
        kind = frame.WhichOneof("msg")
        if kind in ("call", "fetch"):
            self.recorded += 1
        if kind == "call":
            call = frame.call
            if len(call.args) == 1 and call.args[0].tensor.HasField("persistent"):
                # Bind-only (a weight's first use in the session gets its id): bookkeeping, not
                # the app's work. Left out, the first inference looks like the steady state.
                self._note_persistent(call)
                return
            if len(self.calls) >= self.max_calls:
                # Keep the newest half: a sequence search needs the recent steady state.
                drop = self.max_calls // 2
                for old in self.calls[:drop]:
                    self._note_persistent(old)
                del self.calls[:drop]
                self.truncated += drop
                self.generation += 1
                self._built = {}
                keep = [(i, n - drop) for i, n in zip(self.fetched, self.fetch_after, strict=True)
                        if n >= drop]
                # Replies of the calls kept (rebuilt ones included), and of calls not logged yet
                kept = {c.seq for c in self.calls if c.want_meta}
                last = self.calls[-1].seq if self.calls else 0
                self.results = {q: r for q, r in self.results.items()
                                if q in kept or last < q < REBUILT_SEQS}
                self.fetched = [i for i, _ in keep]
                self.fetch_after = [n for _, n in keep]
                self.quiet &= set(self.fetched)
                self.marks = [(n - drop, t) for n, t in self.marks if n >= drop]
            self.calls.append(frame.call)
            self._threads.add(frame.call.thread)
        elif kind == "fetch":
            self.fetched.append(frame.fetch.id)
            self.fetch_after.append(len(self.calls))
            early = self._early.pop(frame.fetch.seq, None)
            if early is not None:
                self._keep_value(frame.fetch.id, early)
            elif len(self._fetching) < MAX_VALUES:
                self._fetching[frame.fetch.seq] = frame.fetch.id

    def mark(self, thread: int) -> None:
        """An inference of ``thread`` ended here (the shim's ``InferenceMark``, which it
        sends with its next write): that thread's next call starts its next inference. The
        same mark again with no call between (replayed inferences log none) is kept once."""
        at = (len(self.calls), thread)
        if self.marks and self.marks[-1] == at:
            return
        if len(self.marks) >= MAX_MARKS:
            with self._insert_lock:
                del self.marks[: MAX_MARKS // 2]
                self.generation += 1  # entries built with the dropped marks: built afresh
                self._built = {}
        self.marks.append(at)

    def record_fetched(self, fetched: ops_pb2.Fetched) -> None:
        """The host's reply to a fetch: the value, if it is one element (the app read a
        number). Only those are kept, at most ``MAX_VALUES`` (the oldest go first)."""
        if len(fetched.tensor.data) > 8:
            self._fetching.pop(fetched.seq, None)
            return
        value = scalar_of(fetched.tensor)
        tid = self._fetching.pop(fetched.seq, None)
        if value is None:
            return
        if tid is not None:
            self._keep_value(tid, value)
        elif len(self._early) < MAX_VALUES:
            self._early[fetched.seq] = value

    def _keep_value(self, tid: int, value: int | float) -> None:
        if len(self.values) >= MAX_VALUES:
            del self.values[next(iter(self.values))]
        self.values[tid] = value

    def insert(self, at: int, fetches: int, calls: list[ops_pb2.OpCall],
               reads: Sequence[tuple[int, int, int | float | None]] = ()) -> None:
        """Put ``calls`` into the log at position ``at``, before the ``fetches``-th fetch on:
        calls that ran as a replay the app aborted there (``Recorder.observe_replayed``).
        ``reads``: the outputs among them the app took from the host's pushes, as ``(calls
        before the read, store id, value)`` in order; logged as fetches. A value (one number
        read) is one as forwarding logs it, an inference boundary included; another output
        (None) only counts as downloaded: when the app read it is not known."""
        if not calls or at > len(self.calls):
            return
        n = len(calls)
        with self._insert_lock:
            self.generation += 1
            self.calls[at:at] = calls
            self._threads.update(c.thread for c in calls)
            self.fetch_after[fetches:] = [x + n for x in self.fetch_after[fetches:]]
            self.fetched[fetches:fetches] = [tid for _, tid, _ in reads]
            self.fetch_after[fetches:fetches] = [at + before for before, _, _ in reads]
            self.marks = [(m + n if m > at else m, t) for m, t in self.marks]
            for _, tid, value in reads:
                if value is None:
                    self.quiet.add(tid)
                else:
                    self._keep_value(tid, value)
            self.recorded += n
            self._built = {}

    def record_result(self, result: ops_pb2.OpResult) -> None:
        """The host's reply to a ``want_meta`` call: its output ids and metadata, or the one
        number it returned (``item()`` answered: a value the app read, ``answered_value``)."""
        if result.outs or answered_value(result) is not None:
            self.results[result.seq] = result

    def _note_persistent(self, call: ops_pb2.OpCall) -> None:
        self._note_persistent_into(call, self.persistent_ids)

    def persistent_bindings(self) -> dict[int, bytes]:
        """Every store id bound to a persistent tensor in this log (and before it)."""
        out = dict(self.persistent_ids)
        for call in self.calls:
            self._note_persistent_into(call, out)
        return out

    @staticmethod
    def _note_persistent_into(call: ops_pb2.OpCall, out: dict[int, bytes]) -> None:
        for ref in iter_tensor_refs(call):
            if ref.WhichOneof("ref") == "persistent" and ref.bind_id:
                out[ref.bind_id] = ref.persistent

    def __len__(self) -> int:
        return len(self.calls)

    def clear(self) -> None:
        for call in self.calls:  # weights bound by these calls stay known as persistent
            self._note_persistent(call)
        self.calls.clear()
        self._threads.clear()
        self.fetched.clear()
        self.fetch_after.clear()
        self.results.clear()
        self.values.clear()
        self.quiet.clear()
        self.marks.clear()
        self._fetching.clear()
        self._early.clear()
        self.truncated = self.recorded = 0
        self.generation += 1
        self.cleared += 1
        self._built = {}

    def entries(self, thread: int | None = None) -> list[LoggedCall]:
        """The log as comparable entries (one thread's calls when ``thread`` is given).
        ``LoggedCall.index`` is the position among those entries; ``raw[i]`` is its frame."""
        # Snapshots: the relay may append (or truncate) while a search reads. Fetches first:
        # each names a call logged before it. A truncation in between: take them again.
        while True:
            with self._insert_lock:
                generation = self.generation
                fetched, fetch_after = list(self.fetched), list(self.fetch_after)
                calls = list(self.calls)
                values = dict(self.values)
                quiet = set(self.quiet)
                marks = list(self.marks)
            if generation == self.generation:
                break
        b = self._built.get(thread)
        if b is None or b.generation != generation or b.calls > len(calls):
            b = self._built[thread] = _Built(generation)
        n = min(len(fetched), len(fetch_after))
        # positions of the first call after a fetch
        starts = {fetch_after[i] for i in range(n) if fetched[i] not in quiet} if quiet \
            else set(fetch_after[:n])
        metas, writes, out = b.metas, b.writes, b.out
        after_fetch, f = b.after_fetch, b.fetches

        def attribute(upto: int) -> int:
            """Downloads: a fetch names the value as the calls logged before it left it."""
            nonlocal f
            while f < n and fetch_after[f] <= upto:
                entry = writes.producer.get(fetched[f])
                if entry is not None:
                    entry.downloads.append(fetched[f])
                    b.unread.append((entry, fetched[f]))
                f += 1
            return f

        # A ``want_meta`` call's outputs are in its reply: a recent one still waiting for it is
        # left for the next build (a call that failed has no reply: it is not waited for long).
        stop = len(calls)
        for pos in range(max(b.calls, stop - PENDING_REPLIES), stop):
            if calls[pos].want_meta and calls[pos].seq not in self.results:
                stop = pos
                break

        def starts_before(upto: int) -> None:
            """Inference starts: the marks of this thread logged before call ``upto``."""
            while b.marks < len(marks) and marks[b.marks][0] <= upto:
                if thread is None or marks[b.marks][1] == thread:
                    if not b.starts or b.starts[-1] != len(out):
                        b.starts.append(len(out))
                b.marks += 1

        for pos in range(b.calls, stop):
            call = calls[pos]
            attribute(pos)
            starts_before(pos)
            after_fetch = after_fetch or pos in starts
            if thread is not None and call.thread != thread:
                continue
            refs: list[Ref] = []
            kwargs = call.kwargs
            sig = (call.op, call.grad_mode, tuple([_value_sig(v, refs, metas) for v in call.args]),
                   tuple([(k, _value_sig(kwargs[k], refs, metas)) for k in sorted(kwargs)])
                   if kwargs else ())
            loose = (call.op, call.grad_mode, tuple([_loose_sig(v, b.ranks) for v in call.args]),
                     tuple([(k, _loose_sig(kwargs[k], b.ranks)) for k in sorted(kwargs)])
                     if kwargs else ())
            result = self.results.get(call.seq) if call.want_meta else None
            outs = tuple(call.out_ids) if result is None else tuple(_result_ids(result))
            exact = hash(sig)
            entry = LoggedCall(len(out), call.seq, call.op, exact, tuple(refs), outs,
                               raw=call, after_fetch=after_fetch, exact=exact,
                               loose=hash(loose), result=result)
            after_fetch = False
            for oid, meta in zip(outs, result.outs if result is not None else call.out_meta,
                                 strict=False):
                metas[oid] = meta.SerializeToString()
                b.ranks[oid] = (meta.dtype, len(meta.shape))
            writes.add(entry)
            out.append(entry)
            if result is not None and not result.outs and len(refs) == 1 \
                    and refs[0][0] == "live":  # ``item()`` answered: a value the app read
                value = answered_value(result)
                producer = writes.producer.get(refs[0][1])
                if value is not None and producer is not None:
                    producer.values[refs[0][1]] = value
        b.calls, b.after_fetch = stop, after_fetch
        b.fetches = attribute(stop)
        starts_before(stop)
        # The values of downloads (a snapshot may be built before a fetch's reply is back)
        for entry, oid in b.unread:
            if oid in values:
                entry.values[oid] = values[oid]
        b.unread = [(e, oid) for e, oid in b.unread[-PENDING_REPLIES:] if oid not in e.values]
        return list(out)

    def inference_starts(self, thread: int | None = None) -> list[int]:
        """Positions in ``entries(thread)`` (as last built) where the thread's inferences
        start, as its marks say; the last may be ``len(entries)``: one ended, the next has
        not begun."""
        b = self._built.get(thread)
        return list(b.starts) if b is not None else []

    def threads(self) -> list[int]:
        """The threads with calls logged since the last clear (one whose calls the log has
        dropped since may be among them: its entries are then none)."""
        return sorted(self._threads)


def copied(e: LoggedCall, key: int) -> LoggedCall:
    """A copy of ``e`` compared by ``key`` (made field by field: ``dataclasses.replace`` costs
    three times as much, on logs of tens of thousands of entries)."""
    return LoggedCall(e.index, e.seq, e.op, key, e.refs, e.outputs, e.downloads, e.after_fetch,
                      e.raw, e.reads, e.exact, e.loose, e.result, e.values)


def with_loose_keys(log: list[LoggedCall]) -> list[LoggedCall]:
    """Copies of ``log``'s entries that a search compares by their loose keys."""
    return [copied(e, e.loose) for e in log]


NUMBERS = ("b", "i", "f")  # the ``Value`` kinds of a number


def answered_value(result: ops_pb2.OpResult) -> int | float | None:
    """The number a call returned (``item()``, forwarded with ``want_meta``), or None."""
    kind = result.value.WhichOneof("kind")
    if kind in NUMBERS and not result.outs:
        v = getattr(result.value, kind)
        return int(v) if kind == "b" else v
    return None


def _result_ids(result: ops_pb2.OpResult) -> list[int]:
    """Output ids of a ``want_meta`` reply, in the order of its ``outs``."""
    ids: list[int] = []

    def walk(v: ops_pb2.Value) -> None:
        kind = v.WhichOneof("kind")
        if kind == "tensor":
            ids.append(v.tensor.id)
        elif kind in ("list", "tuple"):
            for item in getattr(v, kind).items:
                walk(item)
    walk(result.value)
    return ids


def _loose_sig(value: ops_pb2.Value, ranks: dict[int, tuple[str, int]]) -> Any:
    """``_value_sig`` without integers and tensor shapes (dtype and rank stay)."""
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        ref = value.tensor
        rkind = ref.WhichOneof("ref")
        if rkind == "id":
            return ("T", ranks.get(ref.id))
        if rkind == "upload":
            meta = ref.upload.meta
            if ref.bind_id:
                ranks[ref.bind_id] = (meta.dtype, len(meta.shape))
            return ("U", meta.dtype, len(meta.shape))
        return ("P", ref.persistent)
    if kind in ("list", "tuple"):
        return (kind, tuple([_loose_sig(v, ranks) for v in getattr(value, kind).items]))
    if kind == "i":
        return "i"
    if kind == "c":
        return ("c", value.c.real, value.c.imag)
    return (kind, getattr(value, kind)) if kind else None


def _value_sig(value: ops_pb2.Value, refs: list[Ref], metas: dict[int, bytes]) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        ref = value.tensor
        rkind = ref.WhichOneof("ref")
        if rkind == "id":
            refs.append(("live", ref.id))
            return ("T", metas.get(ref.id))
        if rkind == "upload":
            refs.append(("upload", ref.bind_id))
            meta = _meta_key(ref.upload.meta)
            if ref.bind_id:
                metas[ref.bind_id] = meta
            return ("U", meta)
        refs.append(("persistent", ref.persistent))
        return ("P", ref.persistent)
    if kind in ("list", "tuple"):
        items = getattr(value, kind).items
        return (kind, tuple([_value_sig(v, refs, metas) for v in items]))
    if kind == "c":
        return ("c", value.c.real, value.c.imag)
    return (kind, getattr(value, kind)) if kind else None
