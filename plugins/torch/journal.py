"""The calls of the app's open inferences, kept so that a lost host costs the app no error.

Every value the app holds as a proxy lives on the GPU host. When the host is lost mid-inference
(killed, stalled, its link gone), those values are gone with it; what the app still has is its
own copy of every persistent tensor (the weights) and the local tensors it uploaded. The journal
keeps, per operator the session sent to the host (forwarded or replayed), the operator and its
arguments with each proxy as its id; ``rebuild`` runs them again here, in order, natively, and
gives the value of every proxy they made. The app then goes on locally with those values
(``fallback.run_lost``) and reads the outputs it was waiting for as if the host had answered.

What it keeps is bounded: entries from the start of each thread's previous inference on (so a
value the app keeps from one inference to the next, a tracker's last boxes, survives too), at
most ``MAX_CALLS`` calls. A value made before that window, a persistent tensor written on the
host, or a local tensor the app changed in place since it was sent (``Tensor._version``) makes
``rebuild`` refuse: the app then gets ``HostLost`` as before. Never a wrong value.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .proxy import RemoteTensor

MAX_CALLS = 200_000  # beyond this (an app with no module calls, say) nothing more is kept
STALE_AFTER = 64  # begins of other threads after which a thread's window is let go


# An argument as kept: a proxy is ``(_ID, id)`` (an earlier call's output) or ``(_PERSISTENT,
# handle)`` (a weight: its ``local`` copy is the app's own), a local tensor ``(_LOCAL, tensor,
# version)``: an app that writes into it after sending it (a reused frame buffer) leaves no
# trustworthy copy of what was sent. An inference tensor (made under ``inference_mode``) has no
# version counter: a copy is kept (``(_LOCAL, copy, None)``). Tuples, not objects: this runs
# for every operator.
_ID, _PERSISTENT, _LOCAL = object(), object(), object()


_PLAIN = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device,
                    torch.memory_format, torch.layout})


def _token(x: Any) -> Any:
    t = type(x)
    if t in _PLAIN:  # most arguments: checked by exact type first, isinstance is slower
        return x
    if t is list or t is tuple:
        # Most are sizes, strides and paddings: plain items only. A tuple of them is kept as
        # it is (immutable), a list copied in one step (the app may reuse it).
        for v in x:
            if type(v) not in _PLAIN:
                return t([_token(v) for v in x])
        return x if t is tuple else x[:]
    if isinstance(x, RemoteTensor):
        h = x._rrto_handle
        return (_ID, h.id) if h.hash is None else (_PERSISTENT, h)
    if isinstance(x, torch.Tensor):
        # An inference tensor keeps no version: a copy instead. Asked first, as reading its
        # ``_version`` raises: ~11 us a call against ~3, and an app under ``inference_mode``
        # passes one to every ``mask[idx] = True`` (RetinaNet: ~100 a frame).
        if x.is_inference():
            return (_LOCAL, x.clone(), None)
        return (_LOCAL, x, x._version)
    return x


def token_parts() -> dict[str, Any]:
    """What ``shimstep.cpp`` needs to keep a call as ``Journal.add`` does (``hotpath.make``):
    it tokens plain values, lists of them and proxies itself, and the rest with ``token``."""
    return {"plain_types": set(_PLAIN), "token": _token, "id_mark": _ID,
            "persistent_mark": _PERSISTENT, "max_calls": MAX_CALLS}


def _leaves(x: Any, out: list[Any]) -> list[Any]:
    """An operator's result as a flat list (tensors, tuples and lists of them)."""
    if isinstance(x, (list, tuple)):
        for v in x:
            _leaves(v, out)
    else:
        out.append(x)
    return out


class Unrecoverable(Exception):
    """Why the journal cannot give the values the app needs."""


class Journal:
    """The session's calls since the oldest window start (``begin``), in the order they were
    sent. Appended from any app thread under its own lock (never the send lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[tuple[Any, list[Any], dict[str, Any], list[int | None]]] = []
        self._dropped = 0  # calls trimmed off the front, so indices stay absolute
        # thread -> (previous start, current start, begin count): a thread that has started no
        # inference in the last ``STALE_AFTER`` begins (it ended) no longer holds calls back
        self._starts: dict[int, tuple[int, int, int]] = {}
        self._begins = 0
        self.full = False  # MAX_CALLS reached: the window is incomplete until the next trim

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, func: Any, args: tuple, kwargs: dict, result: Any) -> None:
        """Keep one call the host ran (or replays) and the ids of the proxies it returned."""
        # No lock: appends and ``begin``'s trim are single list operations under the GIL.
        if self.full:
            return
        if type(result) is RemoteTensor:
            outs: list[int | None] = [result._rrto_handle.id]
        else:
            outs = [x._rrto_handle.id if isinstance(x, RemoteTensor) else None
                    for x in _leaves(result, [])]
        calls = self._calls
        calls.append((func, [_token(a) for a in args],
                      {k: _token(v) for k, v in kwargs.items()} if kwargs else None, outs))
        if len(calls) >= MAX_CALLS:
            self.full = True

    def begin(self, thread: int) -> None:
        """``thread`` starts an inference: calls before its previous inference's start, and
        before every other thread's, are no longer needed."""
        with self._lock:
            now = self._dropped + len(self._calls)
            self._begins += 1
            previous = self._starts.get(thread, (now, now, 0))[1]
            self._starts[thread] = (previous, now, self._begins)
            for t, (_, _, seen) in list(self._starts.items()):
                if seen < self._begins - STALE_AFTER:
                    del self._starts[t]
            keep_from = min(p for p, _, _ in self._starts.values())
            cut = keep_from - self._dropped
            if cut > 0 and (cut >= len(self._calls) // 2 or self.full):
                del self._calls[:cut]
                self._dropped = keep_from
                self.full = False

    def clear(self) -> None:
        with self._lock:
            self._dropped += len(self._calls)
            self._calls.clear()
            self._starts.clear()
            self.full = False

    def rebuild(self, written: set[int], earlier: dict[int, torch.Tensor],
                thread: int | None = None) -> dict[int, torch.Tensor]:
        """Run every kept call here, in order, on the app's copies: the value of each proxy
        id they made. ``written``: persistent tensors changed on the host (their local copy
        is older); ``earlier``: values rebuilt after an earlier loss (proxies the app kept
        from a host lost before); ``thread``: only the calls since that thread's current
        inference began. Raises ``Unrecoverable`` naming what is missing."""
        with self._lock:
            since = 0
            if thread is not None and thread in self._starts:
                since = max(0, self._starts[thread][1] - self._dropped)
            calls = self._calls[since:]
            full = self.full
        if full:
            raise Unrecoverable(f"more than {MAX_CALLS} calls since the inference began")
        values: dict[int, torch.Tensor] = {}

        def value(x: Any) -> Any:
            if type(x) is tuple and x and x[0] is _ID:
                v = values.get(x[1])
                if v is None:
                    v = earlier.get(x[1])
                if v is None:
                    raise Unrecoverable("a value made before the kept window was used")
                return v
            if type(x) is tuple and x and x[0] is _PERSISTENT:
                h = x[1]
                if h.local is None or h.id in written:
                    raise Unrecoverable("a weight was changed on the GPU host")
                return values.get(h.id, h.local)
            if type(x) is tuple and x and x[0] is _LOCAL:
                if x[2] is not None and x[1]._version != x[2]:
                    raise Unrecoverable("a local tensor changed since it was sent")
                return x[1]
            if type(x) in (list, tuple):
                return type(x)([value(v) for v in x])
            return x

        with torch.no_grad():
            for func, args, kwargs, outs in calls:
                a = [value(x) for x in args]
                kw = {k: value(v) for k, v in kwargs.items()} if kwargs else {}
                try:
                    result = func(*a, **kw)
                except Exception as exc:
                    raise Unrecoverable(f"{func} failed here: {exc}") from None
                for oid, got in zip(outs, _leaves(result, []), strict=False):
                    if oid is not None and isinstance(got, torch.Tensor):
                        values[oid] = got
        return values
