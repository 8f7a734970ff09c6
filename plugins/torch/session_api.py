"""The app session as its parts see it: what proxies, replay, downloads and local fallback
may use of ``client.RemoteSession``.

Those parts need the session (a proxy's handle releases its id there; replay sends frames and
binds weights through it), and the session needs them. Declared here as a ``Protocol``, the
dependency runs one way: the parts depend on this interface, ``client.py`` on the parts, and
nothing on ``client.py``'s internals. ``RemoteSession`` implements it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rrto.v1 import ops_pb2


class PushedOutputs(Protocol):
    """What a download needs of replay: outputs the host pushes without being asked."""

    def is_replayed(self, oid: int) -> bool:
        """Whether ``oid`` is in the replayed outputs' id range."""

    def take(self, oid: int) -> ops_pb2.TensorData | None:
        """The pushed value of ``oid``, waiting for it; None: fetch it the usual way."""


class Session(Protocol):
    """One app session's public interface (``client.RemoteSession``)."""

    counters: Counter[str]  # the shim's figures (``TorchInterceptor.stats``)
    # Ids the app dropped, released on the host with the next frame. Appended from
    # ``Handle.__del__`` in any thread, possibly while the send lock is held: only append.
    released: list[int]
    lost: str | None  # why the connection to the host is gone; None while it is up
    epoch: int  # the connection's number: a new host after a loss is a new epoch
    stale_released: list[int]  # like ``released``, for the ids of earlier epochs
    # proxies written here after a loss or a deadline, or by a forward run here whole
    # (``here.py``): the host's copy is older
    diverged: set[int]
    fallback: str  # "local": run here what the host cannot; "error": raise instead
    replay: PushedOutputs | None
    # a replayed call answered from its step's description (``hotpath.py``), or None: the
    # call goes to ``dispatch``
    hot: Callable[[Any, tuple], Any] | None
    # The calling thread's replay under way and how far the app has matched it, sent with
    # each release frame (``Release.progress``); set by the replay client.
    progress: Callable[[], ops_pb2.ReplayProgress | None] | None
    # Whether this thread is inside an offloaded module's forward (the interceptor sets it):
    # there ``.to("cpu")`` is device plumbing, not the app asking for the data (``proxy``).
    in_forward: Callable[[], bool]

    # -- the wire -----------------------------------------------------------------------------
    def submit(self, up: ops_pb2.SessionUp, numbered: bool = False, wait: bool = False,
               query: bool = False) -> Any:
        """Send ``up`` (after pending releases); wait for its reply when asked."""

    def send_frames(self, frames: list[Any]) -> None:
        """Stream ``frames`` in order without waiting (after pending releases)."""

    def release_now(self, at_least: int) -> None:
        """Send pending releases now, if there are ``at_least``; never raises."""

    def raise_async_errors(self) -> None:
        """Raise the first error the host reported for a streamed call, if any."""

    def add_async_error(self, err: ops_pb2.Error) -> None:
        """An error of a call the app made, to raise at its next read."""

    def bind(self, handle: Any) -> None:
        """Have the host bind a persistent tensor's cached blob to its id (first use of
        ``handle``, a ``proxy.Handle``: typed loosely, proxy.py imports this module)."""

    # -- operators and values -----------------------------------------------------------------
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one aten operator on proxies (``RemoteTensor.__torch_dispatch__``)."""

    def is_late(self) -> bool:
        """Whether this thread's inference goes on here (``past_deadline``, ``finish_here``)."""

    def past_deadline(self) -> bool:
        """Whether this thread's inference now goes on here (its deadline passed)."""

    def finish_here(self, why: str) -> bool:
        """Whether this thread's inference now goes on here, from values the journal rebuilds
        (``why``: "deadline", or "replay": the host could not replay it)."""

    def wait_slice(self, cap: float) -> float:
        """Seconds a wait for the host may block before it looks at the deadline again."""

    def value_after_loss(self, handle: Any) -> torch.Tensor | None:
        """A proxy's value once its host is lost (the app's copy, or rebuilt by the journal);
        None when there is none."""

    def local_is_current(self, handle: Any) -> bool:
        """Whether the app's copy of a persistent tensor (``handle.local``) still holds its
        value: not written on the host since (a buffer the forward updates)."""

    def persist(self, tensors: list[torch.Tensor]) -> list[Any]:
        """Proxies for new persistent tensors (offered by hash, uploaded if missing)."""

    def assign(self, func: Any, args: tuple, kwargs: dict) -> None:
        """``Tensor.__setitem__`` whose value is a proxy with leading ones (``assignment``)."""

    def download(self, proxy: torch.Tensor) -> torch.Tensor:
        """The value of ``proxy``, a ``RemoteTensor`` (an app's data read)."""

    def output_template(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """(result template, outputs) of a call from meta execution; None when data-dependent."""

    def app_device(self, args: tuple, kwargs: dict) -> torch.device:
        """The device the app sees a call's outputs on."""
