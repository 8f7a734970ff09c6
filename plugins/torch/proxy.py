"""``RemoteTensor``: a storage-less tensor whose value lives in the GPU host's session store.

A proxy carries the metadata the app expects (shape, stride, dtype, device, requires_grad), so
autograd, shape checks and Python code run unchanged; every aten operator on it reaches
``__torch_dispatch__`` and is forwarded by the client session. ``__torch_function__`` catches the
data reads that are not aten operators (numpy, tolist, repr, pickling, data_ptr, cpu) and serves
them from a download. Several proxies may share one ``Handle`` (``detach``/``alias`` are answered
locally); the host's copy is released when the last proxy on it is gone.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import slicing
from .copying import deepcopy_proxy
from .session_api import Session


class Handle:
    """One tensor in the host's store. ``hash``/``local``: a persistent tensor's content hash and
    the app's original copy (served for reads before first use, and used when the host is lost)."""

    __slots__ = ("id", "session", "hash", "local", "bound", "epoch", "split", "__weakref__")

    def __init__(self, session: Session, id: int, hash: bytes | None = None,
                 local: torch.Tensor | None = None):
        self.id = id
        self.session = session
        self.hash = hash
        self.local = local
        self.bound = hash is None  # a persistent tensor is bound to its id at first use
        self.epoch = session.epoch  # the connection it was made under (client.swap)
        # A split region's value (``rrtod.lop``): its rows (0: not one). ``local`` holds its
        # first rows (all, once put together: ``downloads.whole``), the host only a band of
        # its last under ``id``
        self.split = 0

    def __del__(self) -> None:
        # Runs in any thread, possibly while the session's send lock is held: only append.
        try:
            if self.bound:
                s = self.session
                (s.released if self.epoch == s.epoch else s.stale_released).append(self.id)
        except Exception:  # interpreter shutdown
            pass


class RemoteTensor(torch.Tensor):
    _rrto_handle: Handle
    # Download kept alive for data_ptr()/storage users; a class default, so that a new proxy
    # (one per replayed output) sets one attribute, not two.
    _rrto_keep: torch.Tensor | None = None

    @staticmethod
    def __new__(cls, handle: Handle, shape: Any, stride: Any, offset: int, dtype: torch.dtype,
                device: torch.device | str, requires_grad: bool = False) -> RemoteTensor:
        return new_proxy(handle, shape, stride, offset, dtype, device, requires_grad, cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    __deepcopy__ = deepcopy_proxy  # a host-side clone, not a copy of the session (copying.py)

    # -- module.to()/_apply and deepcopy treat us as a traceable wrapper subclass ---------------
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [], (self._rrto_handle,)

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        (handle,) = ctx
        return RemoteTensor(handle, outer_size, outer_stride, 0, torch.float32, "cpu")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        return repr(self._rrto_handle.session.download(self))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        # Nearly every operator has a proxy as its first argument: find its session without
        # a loop (this runs for every operator on a proxy, before the client's dispatch).
        first = args[0] if args else None
        if isinstance(first, RemoteTensor):
            session = first._rrto_handle.session
        else:
            session = _session_of(args, kwargs)
        t0 = perf_counter_ns()
        try:
            if not kwargs:
                hot = session.hot
                if hot is not None:
                    result = hot(func, args)
                    if result is not None:
                        return result
            return session.dispatch(func, args, kwargs or {})
        finally:
            stats = session.counters
            stats["shim_ns"] += perf_counter_ns() - t0  # includes waits for the host
            stats["ops"] += 1

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        if func not in _SPECIAL and type(func) is not _METHOD_WRAPPER:
            # Every other call: itself, with torch functions off for subclasses (as ``with
            # DisableTorchFunctionSubclass()``, without the context manager's Python; it
            # takes no ``None`` for keyword arguments).
            return _DISABLED(func, types, args, kwargs) if kwargs else _DISABLED(func, types, args)
        kwargs = kwargs or {}
        reader = _READS.get(func)
        if reader is not None:
            return reader(args, kwargs)
        if func is _GETITEM and len(args) == 2 and isinstance(args[0], RemoteTensor) \
                and slicing.bounded(args[1]):
            return slicing.view(args[0], args[1])  # the same calls whatever the bounds
        if func is _SETITEM and len(args) == 3 and isinstance(args[0], RemoteTensor) \
                and slicing.bounded(args[1]):
            args = (slicing.view(args[0], args[1]), Ellipsis, args[2])
        if func is _SETITEM and len(args) == 3 and isinstance(args[2], RemoteTensor) and (
                args[2].dim() and args[2].shape[0] == 1):
            return args[2]._rrto_handle.session.assign(func, args, kwargs)
        if type(func) is _METHOD_WRAPPER and getattr(func, "__self__", None) is _DATA:
            if func.__name__ == "__set__":
                return _set_data(args[0], args[1])
        out = _DISABLED(func, types, args, kwargs)
        if func is _TO and isinstance(out, RemoteTensor) and _names_cpu(args[1:], kwargs):
            # ``.to("cpu")`` in the app's own code asks for the data, as ``.cpu()`` does. In a
            # model's forward it keeps a tensor on its input's device (``grid.to(x.device)``,
            # and a proxy's device reads "cpu"): downloading there cost a round trip per call,
            # and made a block of them look like an inference of its own to the search.
            session = out._rrto_handle.session
            if not session.in_forward():
                return session.download(out)
        return out


def new_proxy(handle: Handle, shape: Any, stride: Any, offset: int, dtype: torch.dtype,
              device: torch.device | str, requires_grad: bool = False,
              cls: type[RemoteTensor] = RemoteTensor) -> RemoteTensor:
    """A proxy on ``handle`` with the given metadata. Cheaper than ``RemoteTensor(...)``,
    which also runs ``__init__`` through the class call: replay makes one per output."""
    r = torch.Tensor._make_wrapper_subclass(
        cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=device,
        requires_grad=requires_grad,
    )
    r._rrto_handle = handle
    return r


def _session_of(args: tuple, kwargs: dict | None) -> Session:
    """The session of the first proxy among the arguments (the slow path of dispatch)."""
    for a in args:
        if isinstance(a, RemoteTensor):
            return a._rrto_handle.session
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, RemoteTensor):
                    return b._rrto_handle.session
    for v in (kwargs or {}).values():
        if isinstance(v, RemoteTensor):
            return v._rrto_handle.session
    # e.g. only an out= argument, or a proxy nested deeper, is a proxy
    found: list[RemoteTensor] = []
    tree_map(lambda x: found.append(x) if isinstance(x, RemoteTensor) else None, (args, kwargs))
    return found[0]._rrto_handle.session


_DATA = torch._C.TensorBase.data  # the ``.data`` property: ``p.data = t`` calls its __set__
_METHOD_WRAPPER = type(_DATA.__set__)


def _set_data(proxy: RemoteTensor, new: torch.Tensor) -> None:
    """``proxy.data = new`` (re-parameterizing nets assign fused kernels this way). torch swaps
    the tensor under the Python object, which keeps its attributes: the proxy would go on
    naming its old value on the host. So it takes ``new``'s handle, and a local ``new`` first
    becomes a persistent tensor of the session (offered by hash, uploaded if missing)."""
    if not isinstance(new, RemoteTensor):
        new = proxy._rrto_handle.session.persist([new.detach()])[0]
    with torch._C.DisableTorchFunctionSubclass():
        _DATA.__set__(proxy, new)
    proxy._rrto_handle = new._rrto_handle


def _names_cpu(args: tuple, kwargs: dict) -> bool:
    for v in (*args, kwargs.get("device")):
        if (isinstance(v, str) and v == "cpu") or (
                isinstance(v, torch.device) and v.type == "cpu"):
            return True
    return False


def _download(args: tuple) -> torch.Tensor:
    self = args[0]
    return self._rrto_handle.session.download(self)


def _via_download(name: str):
    method = getattr(torch.Tensor, name)

    def read(args: tuple, kwargs: dict) -> Any:
        return method(_download(args), *args[1:], **kwargs)
    return read


def _kept(name: str):
    """data_ptr()/storage: the pointer must stay valid while the proxy lives, so keep the copy."""
    method = getattr(torch.Tensor, name)

    def read(args: tuple, kwargs: dict) -> Any:
        self = args[0]
        real = _download(args)
        self._rrto_keep = real
        return method(real, *args[1:], **kwargs)
    return read


def _cpu(args: tuple, kwargs: dict) -> torch.Tensor:
    return _download(args)


_TO = torch.Tensor.to
_SETITEM = torch.Tensor.__setitem__  # a value with leading ones: ``assignment.py``
_GETITEM = torch.Tensor.__getitem__  # a bounded slice: ``slicing.py``
_READS: dict[Any, Any] = {
    getattr(torch.Tensor, n): _via_download(n)
    for n in ("numpy", "tolist", "__array__", "__format__", "__reduce_ex__", "__dlpack__",
              "__dlpack_device__", "item", "__bool__", "__int__", "__float__", "__index__",
              "__complex__", "__array_wrap__")
    if hasattr(torch.Tensor, n)
}
_READS.update({getattr(torch.Tensor, n): _kept(n) for n in (
    "data_ptr", "untyped_storage", "storage", "_typed_storage") if hasattr(torch.Tensor, n)})
_READS[torch.Tensor.cpu] = _cpu
_READS[torch.Tensor.__repr__] = lambda args, kwargs: repr(_download(args))
_SPECIAL = frozenset({*_READS, _SETITEM, _GETITEM, _TO})  # what ``__torch_function__`` handles itself
_DISABLED = torch._C._disabled_torch_function_impl
