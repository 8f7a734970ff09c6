"""The shim's hot path: a replayed call that meets a step already seen, exactly as it met it.

Most replayed calls are the same every inference: the same operator on the previous calls'
outputs and the model's bound weights, with the same sizes and plain arguments, making one new
tensor of a known layout. The general path (``RemoteTensor.__torch_dispatch__`` through
``RemoteSession.dispatch`` to ``ReplayClient.dispatch``) works each of those out again through
eight Python frames; here one function checks a step's ``Fast`` description and makes the proxy.

The description says only what is enough for the general path to answer the call the same way
(``ReplayClient.dispatch`` builds it after it did): anything else - a value read, an upload, a
weight not bound yet, a host failure, an assignment, a lost host - returns None, having changed
nothing, and the call takes the general path. ``shimstep.cpp`` does the same in C++ where it is
built (``native.py``); this module is its fallback, and its specification.
"""

from __future__ import annotations

from time import thread_time_ns
from typing import Any, NamedTuple

import torch

from rrto.v1 import ops_pb2

from . import native
from .codec import contiguous_strides
from .journal import Journal, token_parts
from .metadata import OpInfo
from .proxy import Handle, RemoteTensor
from .recorded import SCALARS, TENSOR, is_plain
from .session_api import Session

# A tensor argument's check: (position, kind, what it must be)
PRODUCED = 0  # an output of this inference: its id is the inference's base + local index
BOUND = 1  # a weight: the very handle bound at that slot (``Sequence.bindings[key]``)
CONSTANT = 2  # a tensor of the session recorded as itself: its id

SRC = ops_pb2.SeqSource
_MAKE = torch.Tensor._make_wrapper_subclass


class Fast(NamedTuple):
    """What a step's call must be to be answered on the hot path, and what it gives. A tuple:
    the native hot path reads its items by position."""

    func: Any  # the OpOverload (identity)
    info: OpInfo  # its client-side facts (``local`` is read per call: it may change)
    grad_mode: int  # ``grad_mode()`` as recorded
    count: int  # positional arguments (no keyword arguments)
    # per tensor argument: (position, item in the list there or -1, PRODUCED/BOUND/CONSTANT,
    # what it must be)
    tensors: tuple[tuple[int, int, int, Any], ...]
    plain: tuple[tuple[int, Any, type, tuple[type, ...] | None], ...]  # as ``Step.flat``
    # lists that hold tensors (``cat``, ``index``): (position, list or tuple, length, per
    # other item (item, value, type))
    lists: tuple[tuple[int, type, int, tuple[tuple[int, Any, type], ...]], ...]
    # What the call gives: its argument at ``alias`` (>= 0: written in place and returned,
    # ``relu_``), else a new tensor, local index ``local``, of ``shape`` (None: of the sizes
    # the host pushed for it, ``rank`` of them, C-contiguous: ``ReplaySizes``), laid out as
    # ``layout`` says (``_make_wrapper_subclass``'s keyword arguments; strides of pushed
    # sizes are added per call)
    alias: int
    local: int
    shape: tuple[int, ...] | None
    rank: int
    layout: dict[str, Any]


def describe(seq: Any, step: Any, func: Any, info: OpInfo) -> Fast | None:
    """The hot path's description of a step ``ReplayClient.dispatch`` just answered with one
    new tensor of a layout fixed at its first replay, with one new C-contiguous tensor of the
    sizes the host pushed or answered, or with the one argument it writes in place; None where the general
    path must answer its calls (an upload, a value, a call run here, other results, outputs
    that later calls' sizes are worked out from, keyword arguments)."""
    built = step.built
    answered = step.answered and step.dense is not None  # (made from its sizes)
    if (step.syms or step.any_shape or step.robot or (step.answered and not answered)
            or step.bands or step.fixed
            or step.kwargs or info.value_op or info.alias_only or info.inplace_view
            or info.local or any(i in seq.sized for i in step.out_local if i is not None)):
        return None
    places, plain, lists = [], [], []  # (``ReplayClient._match`` checks tensors in this order)
    for pos, a in enumerate(step.args):
        if a is TENSOR:
            places.append((pos, -1))
        elif isinstance(a, (list, tuple)) and any(b is TENSOR for b in a):
            if not all(b is TENSOR or type(b) in SCALARS for b in a):
                return None
            places.extend((pos, j) for j, b in enumerate(a) if b is TENSOR)
            lists.append((pos, type(a), len(a), tuple((j, b, type(b)) for j, b in enumerate(a)
                                                      if b is not TENSOR)))
        elif is_plain(a):
            plain.append((pos, a, type(a), tuple(map(type, a))
                          if isinstance(a, (list, tuple)) else None))
        else:
            return None
    tensors = []
    for (pos, item), (slot, kind, aux) in zip(places, step.checks, strict=True):
        if kind == SRC.PRODUCED:
            tensors.append((pos, item, PRODUCED, aux))
        elif kind == SRC.PERSISTENT:
            key = seq.canon[slot] if seq.canon is not None else slot
            tensors.append((pos, item, BOUND, key))
        elif kind == SRC.INPUT:
            return None
        else:
            tensors.append((pos, item, CONSTANT, seq.definition.sources[slot].id))
    produced = {pos for pos, item, kind, _ in tensors if kind == PRODUCED and item < 0}
    head = (func, info, step.grad_mode, len(step.args), tuple(tensors), tuple(plain),
            tuple(lists))
    if built is not None and built.plan == [None]:
        # the argument it writes in place, returned: this inference's value (``relu_``)
        alias = info.ret_alias[0] if len(info.ret_alias) == 1 else None
        if (alias is None or len(built.outs) != 1 or built.template is not built.outs[0]
                or [w[0] for w in info.writes] != [alias[0]] or alias[0] not in produced):
            return None
        return Fast(*head, alias[0], -1, None, 0, {})
    if info.writes:
        return None
    if step.variable or answered:  # one new C-contiguous tensor of the sizes the host pushes
        if step.dense is None:
            return None
        i, dtype, device, rank = step.dense
        return Fast(*head, -1, i, None, rank, {"storage_offset": 0, "dtype": dtype,
                                                "device": device, "requires_grad": False})
    if built is None or built.single is None:
        return None
    i, shape, stride, offset, dtype = built.single  # one new tensor of a fixed layout
    return Fast(*head, -1, i, tuple(shape), len(shape), {
        "strides": tuple(stride), "storage_offset": offset, "dtype": dtype,
        "device": built.device, "requires_grad": False})


def grad_mode() -> int:
    """The calling thread's autograd mode as the wire says it (``ops_pb2.GradMode``): what a
    forwarded call records and a replayed step matches."""
    if torch.is_inference_mode_enabled():
        return ops_pb2.INFERENCE_MODE
    return ops_pb2.GRAD_ENABLED if torch.is_grad_enabled() else ops_pb2.NO_GRAD


class HotPath:
    """Per session: answers a call from the step its thread's replay expects, or says None.

    ``timed`` is the sampling of ``RemoteSession._remote``: a timed call adds the whole hot
    path's CPU time (journal included) to ``replay_shim_ns``."""

    def __init__(self, session: Session, replay: Any, journal: Journal, sample: Any,
                 share: float, release_at: int):
        self.session, self.replay, self.journal = session, replay, journal
        self._tls = replay._tls
        self._sample, self._share, self._release_at = sample, share, release_at

    def __call__(self, func: Any, args: tuple) -> RemoteTensor | None:
        timed = self._sample() < self._share
        t0 = thread_time_ns() if timed else 0
        result = self._step(func, args)
        if result is not None and timed:
            counters = self.session.counters
            counters["replay_shim_ns"] += thread_time_ns() - t0
            counters["replay_timed"] += 1
        return result

    def _step(self, func: Any, args: tuple) -> RemoteTensor | None:
        session, replay = self.session, self.replay
        if (session._assigning or session.lost is not None or session._late
                or session.diverged or replay._give_up):
            return None
        act = getattr(self._tls, "active", None)
        if act is None or act.joined is not None or act.timing is not None or (
                replay._broken and act.base in replay._broken):
            return None
        seq = act.seq
        fast = seq.fast
        p = act.position
        f = fast[p] if p < len(fast) else None
        if not f or f.func is not func or len(args) != f.count or f.info.local \
                or (seq.root or seq).failed or f.grad_mode != grad_mode():
            return None
        for i, v, vt, item_types in f.plain:
            a = args[i]
            if type(a) is not vt or (item_types is not None and tuple(map(type, a)) != item_types) \
                    or a != v:
                return None
        for i, seqtype, n, items in f.lists:
            a = args[i]
            if type(a) is not seqtype or len(a) != n:
                return None
            for j, v, vt in items:
                if type(a[j]) is not vt or a[j] != v:
                    return None
        base = act.base
        bindings = seq.bindings
        for i, j, kind, aux in f.tensors:
            t = args[i] if j < 0 else args[i][j]
            if not isinstance(t, RemoteTensor):
                return None
            h = t._rrto_handle
            if kind == PRODUCED:
                if h.id != base + aux:
                    return None
            elif kind == BOUND:
                if bindings.get(aux) is not h:
                    return None
            elif h.id != aux:
                return None
        # Matched: the result (made first: it changes nothing, and may still fail)
        if f.alias >= 0:
            result = args[f.alias]
            if result._rrto_handle.local is not None:
                return None  # (a value the robot made: the general path notes the write)
        else:
            if f.shape is not None:
                result = _MAKE(RemoteTensor, f.shape, **f.layout)
            else:
                known = replay._sizes.get(base)
                dims = known.get(p) if known is not None else None
                if dims is None or len(dims) != f.rank:
                    return None  # (not pushed yet: the general path works them out)
                try:
                    result = _MAKE(RemoteTensor, dims, strides=contiguous_strides(dims),
                                   **f.layout)
                except (RuntimeError, OverflowError, ValueError, TypeError):
                    return None  # sizes no tensor can have (as ``ReplayClient._dense``)
            result._rrto_handle = Handle(session, base + f.local)
        # from here on as the general path commits it
        act.position = p + 1
        counters = replay.counters
        if f.shape is None and f.alias < 0:
            counters["sized"] += 1
        counters["replayed_ops"] += 1
        counters["hot"] += 1
        session.release_now(self._release_at)
        if p + 1 == len(seq.steps):
            replay.ended(act)
        self.journal.add(func, args, {}, result)
        return result


def make(session: Session, replay: Any, journal: Journal, sample: Any, share: float,
         release_at: int) -> Any:
    """The session's hot path: ``shimstep.cpp``'s where it is built, else ``HotPath``."""
    mod = native.module("shimstep")
    if mod is None:
        return HotPath(session, replay, journal, sample, share, release_at)
    _install_dispatch(mod)
    return mod.HotPath({
        "session": session, "replay": replay, "journal": journal, "tls": replay._tls,
        "assigning": session._assigning, "late": session._late, "diverged": session.diverged,
        "broken": replay._broken, "sizes": replay._sizes, "session_counters": session.counters,
        "replay_counters": replay.counters, "remote_type": RemoteTensor, "handle_type": Handle,
        "make": _MAKE, "is_inference": torch.is_inference_mode_enabled,
        "is_grad": torch.is_grad_enabled, "release_at": release_at,
        "grad_enabled": ops_pb2.GRAD_ENABLED, "no_grad": ops_pb2.NO_GRAD,
        "inference_mode": ops_pb2.INFERENCE_MODE, "seed": int(sample() * (1 << 62)),
        "share": share, **token_parts()})


def _install_dispatch(mod: Any) -> None:
    """``RemoteTensor.__torch_dispatch__`` becomes the native ``Dispatch``: it asks a native
    hot path first, with no Python frame between torch and it, and passes everything else on
    to the Python one (``proxy.RemoteTensor.__torch_dispatch__``, kept as it is)."""
    current = RemoteTensor.__dict__["__torch_dispatch__"].__func__
    if not isinstance(current, mod.Dispatch):
        RemoteTensor.__torch_dispatch__ = classmethod(mod.Dispatch(current, RemoteTensor))
