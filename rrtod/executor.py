"""The host-side contract between the GPU daemon and an interception backend's executor.

The GPU daemon owns transport, sessions and isolation; the executor owns what a frame means.
Each session gets its own executor object, driven from one dedicated worker thread, so an
executor needs no locking and a slow model never stalls another session or the event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rrto.v1 import ops_pb2


@dataclass(frozen=True)
class ExecutorContext:
    """What the daemon hands an executor factory: ``record.executor(ctx)``."""

    device: str  # "auto", "cpu", "cuda", "cuda:1" ... from config executor.device
    memory_quota: int  # bytes of live tensors this session may hold
    allow_extra: tuple[str, ...]
    deny: tuple[str, ...]
    blobs: BlobStoreLike  # the host's content-addressed weight cache
    state_dir: Path
    identity: str = "local"  # who opened the session: the robot's certificate identity


class BlobStoreLike(Protocol):
    """The weight cache as one identity sees it (``ExecutorContext.identity``): entries others
    uploaded are missing to it unless the cache is shared."""

    def has(self, key: bytes, identity: str) -> bool: ...
    def put(self, key: bytes, tensor: ops_pb2.TensorData, identity: str) -> None: ...
    def get(self, key: bytes, identity: str) -> ops_pb2.TensorData | None: ...


class Executor(Protocol):
    """One app session on the host."""

    def open(self, request: ops_pb2.SessionOpen) -> ops_pb2.SessionReady: ...

    def handle(self, frame: ops_pb2.SessionUp) -> Iterable[ops_pb2.SessionDown]:
        """Execute one frame; yield the replies it produces (none for a streamed call).
        Errors are replied as ``SessionDown(error=...)``, never raised, except for bugs."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for status/metrics: at least ``ops`` (operators executed) and ``bytes_live``."""
        ...

    # Optional, for replay of sequences that overwrite existing values in place:
    #   snapshot(ids) -> token   copies of those tensors
    #   restore(token)           write the copies back (in place, keeping views valid)

    def close(self) -> None:
        """Free everything the session holds. Called once, also when the app vanished."""
        ...
