"""Reading a proxy's value in the app: the only place where the app waits for a tensor.

A value is served from the cheapest place that has it: a persistent tensor never used on the
host from the app's own copy; a replayed output from what the host pushed during replay (no
round trip); anything else from one ``Fetch`` round trip; once the host is lost, from the values
the session's journal rebuilds here. Whatever the source, the app gets a
plain tensor with the proxy's shape and strides, and an error the host reported for a streamed
call is raised here, at the read that depends on it.
"""

from __future__ import annotations

import torch

from rrto.v1 import ops_pb2

from . import codec
from .errors import DeadlineMissed, HostLost
from .proxy import Handle, RemoteTensor
from .session_api import Session


def read_value(session: Session, proxy: RemoteTensor) -> torch.Tensor:
    """The value of ``proxy``, from the app's copy, a pushed output or a fetch."""
    h = proxy._rrto_handle
    if h.split:  # a split region's value: the host's copy is only its last rows
        whole(session, proxy)
        return shape_like(h.local, proxy)
    if not h.bound and h.local is not None:  # persistent, never used remotely: exact copy
        return shape_like(h.local, proxy)
    if session.lost is not None or h.epoch != session.epoch or h.id in session.diverged \
            or session.is_late():
        return _after_loss(session, proxy)
    replay = session.replay
    try:
        if replay is not None and replay.is_replayed(h.id):
            data = replay.take(h.id)  # pushed by the host during replay: no round trip
            session.raise_async_errors()
            if data is not None:
                session.counters["bytes_down"] += len(data.data) + len(data.palette)
                return shape_like(codec.from_tensor_data(data), proxy)
            if session.lost is not None or session.is_late():
                return _after_loss(session, proxy)
        # (read inside a forward: the robot's searches wait for the inference's end)
        fetch = ops_pb2.Fetch(id=h.id, in_forward=session.in_forward())
        reply = session.submit(ops_pb2.SessionUp(fetch=fetch), numbered=True, wait=True)
    except HostLost:
        if session.fallback != "local":
            raise
        return _after_loss(session, proxy)
    except DeadlineMissed:
        return _after_loss(session, proxy)
    session.raise_async_errors()
    session.counters["bytes_down"] += len(reply.tensor.data) + len(reply.tensor.palette)
    return shape_like(codec.from_tensor_data(reply.tensor), proxy)


def whole(session: Session, proxy: RemoteTensor) -> None:
    """Make a split value's handle hold all its rows (``Handle.split``): the robot's first
    rows and the host's band of the rest, pushed during replay or fetched."""
    h = proxy._rrto_handle
    if h.local is not None and h.local.shape[-2] == h.split:
        return
    replay = session.replay
    data = replay.take(h.id) if replay is not None and replay.is_replayed(h.id) else None
    if data is None:
        if session.lost is not None or h.epoch != session.epoch:
            raise HostLost(f"{session.lost or 'the GPU host was lost'}; the last rows of "
                           "this tensor lived on it")
        reply = session.submit(ops_pb2.SessionUp(fetch=ops_pb2.Fetch(id=h.id)),
                               numbered=True, wait=True)
        session.raise_async_errors()
        data = reply.tensor
    session.counters["bytes_down"] += len(data.data) + len(data.palette)
    put_together(h, codec.from_tensor_data(data))


def put_together(h: Handle, rest: torch.Tensor) -> None:
    """``h.local``, the first rows of a split value, and ``rest``, the host's band of its
    last rows (the two meet or overlap: ``rrtod.lop``), as one tensor of all its rows."""
    if h.local is None or h.local.shape[-2] == h.split:
        return
    first = h.local.narrow(-2, 0, h.split - rest.shape[-2])
    h.local = torch.cat([first, rest.to(first.device)], -2)


def _after_loss(session: Session, proxy: RemoteTensor) -> torch.Tensor:
    """The host that made ``proxy`` is gone (or late, or older): its value as the journal
    rebuilt it here, or as the app computed it here since."""
    t = session.value_after_loss(proxy._rrto_handle) if session.fallback == "local" else None
    if t is None:
        raise HostLost(f"{session.lost or 'the GPU host was lost'}; the value of this tensor "
                       "lived on the GPU host")
    session.counters["rebuilt_reads"] += 1
    return shape_like(t, proxy)


def shape_like(t: torch.Tensor, proxy: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with the proxy's shape and strides (what a local tensor would have)."""
    t = t.detach()
    if tuple(t.shape) != tuple(proxy.shape):
        t = t.reshape(proxy.shape)
    if t.stride() != proxy.stride() and t.numel() > 1:
        t = torch.empty_strided(proxy.shape, proxy.stride(), dtype=t.dtype).copy_(t)
    if proxy.requires_grad:
        t = t.requires_grad_(False)
    return t
