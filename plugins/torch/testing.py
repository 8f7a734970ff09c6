"""An app session wired straight to an in-process executor: fast tests and benchmarks of the
whole client/host path (encoding included) without daemons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rrtod.executor import ExecutorContext
from rrtod.gpu.blobstore import BlobStore
from rrtod.shim.channel import LoopbackChannel

from .executor import TorchExecutor
from .interceptor import TorchInterceptor


def loopback(state_dir: Path, mode: str = "stream", fallback: str = "local",
             memory_quota: int = 1 << 30, allow_extra: tuple[str, ...] = (),
             deny: tuple[str, ...] = (), blobs: BlobStore | None = None,
             cache_bytes: int = 1 << 30, takeover: bool = False,
             replay: bool = True, channel: Any = None,
             deadline_ms: float | None = None) -> TorchInterceptor:
    """An installed interceptor whose host is a ``TorchExecutor`` in this process.
    ``interceptor.session.channel.executor`` is the host; call ``uninstall()`` when done.
    ``takeover``: after the host is lost, a new host (a new executor with an empty weight
    cache) takes the session when it reconnects. ``channel``: wraps the loopback channel (a
    slow or stalled host in tests)."""
    from . import make_interceptor

    def executor(name: str, blobs: BlobStore | None) -> TorchExecutor:
        return TorchExecutor(ExecutorContext(
            device="auto", memory_quota=memory_quota, allow_extra=allow_extra, deny=deny,
            blobs=blobs if blobs is not None else BlobStore(Path(state_dir) / name, cache_bytes),
            state_dir=Path(state_dir)))

    hosts = iter(range(1, 1 << 30))
    reopen = (lambda: executor(f"blobs-{next(hosts)}", None)) if takeover else None
    loop = LoopbackChannel(executor("blobs", blobs), reopen=reopen)
    return make_interceptor(loop if channel is None else channel(loop), mode=mode,
                            fallback=fallback, replay=replay, deadline_ms=deadline_ms)
