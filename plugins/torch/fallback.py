"""Operators that run in the app instead of on the host, with the same result.

Three cases keep a call local: the host does not allow the operator (``fallback: local``), the
operator writes into a plain local tensor, or the host is lost. The first two download the
proxies the call reads, run it here and write mutated proxies back, so the host's copies stay in
step; the last can only use the app's own copies of persistent tensors (weights), since
everything else lived on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import HostLost
from .metadata import OpInfo, arg_at
from .proxy import RemoteTensor
from .session_api import Session


def writes_local(args: tuple, kwargs: dict, info: OpInfo) -> bool:
    """Whether the operator writes into a plain local tensor (then it runs locally)."""
    for i, n in info.writes:
        target = arg_at(args, kwargs, i, n)
        if isinstance(target, torch.Tensor) and not isinstance(target, RemoteTensor):
            return True
    return False


def run_local(session: Session, func: Any, args: tuple, kwargs: dict, info: OpInfo) -> Any:
    """Download the proxies, run ``func`` here, write mutated proxies back to the host."""
    session.counters["local_ops"] += 1
    real: dict[int, torch.Tensor] = {}
    largs = _downloaded(session, args, real)
    lkwargs = {k: _downloaded(session, v, real) for k, v in kwargs.items()}
    result = func(*largs, **lkwargs)
    for i, n in info.writes:  # keep the host's copy of a mutated proxy in step
        target = arg_at(args, kwargs, i, n)
        if isinstance(target, RemoteTensor):
            session.dispatch(torch.ops.aten.copy_.default, (target, real[id(target)]), {})
    # Outputs that alias a mutated proxy are that proxy, as they would be locally.
    for k, alias in enumerate(info.ret_alias):
        if alias is not None and isinstance(arg_at(args, kwargs, *alias), RemoteTensor):
            if isinstance(result, tuple):
                result = result[:k] + (arg_at(args, kwargs, *alias),) + result[k + 1:]
            else:
                result = arg_at(args, kwargs, *alias)
    return result


def run_lost(session: Session, func: Any, args: tuple, kwargs: dict) -> Any:
    """The host is gone: persistent tensors still have their local copy; nothing else does."""
    if session.fallback != "local":
        raise HostLost(session.lost or "")
    return func(*_local_copies(session, args, func),
                **{k: _local_copies(session, v, func) for k, v in kwargs.items()})


# Recursive helpers are module functions, never closures: a recursive closure is a reference
# cycle that would keep the call's proxies (and the host's tensors) alive until the cyclic
# garbage collector runs.
def _downloaded(session: Session, x: Any, real: dict[int, torch.Tensor]) -> Any:
    if isinstance(x, RemoteTensor):
        if id(x) not in real:
            real[id(x)] = session.download(x).clone()
        return real[id(x)]
    if isinstance(x, (list, tuple)):
        return type(x)(_downloaded(session, v, real) for v in x)
    return x


def _local_copies(session: Session, x: Any, func: Any) -> Any:
    if isinstance(x, RemoteTensor):
        t = session.value_after_loss(x._rrto_handle)
        if t is None:
            raise HostLost(f"{session.lost or 'the GPU host was lost'}; the value of a tensor used by "
                           f"{func} lived on the GPU host")
        return t if tuple(t.shape) == tuple(x.shape) else t.view(x.shape)
    if isinstance(x, (list, tuple)):
        return type(x)(_local_copies(session, v, func) for v in x)
    return x
