"""An app session wired straight to an in-process executor: fast tests and benchmarks of the
whole client/host path (encoding included) without daemons."""

from __future__ import annotations

from pathlib import Path

from rrtod.executor import ExecutorContext
from rrtod.gpu.blobstore import BlobStore
from rrtod.shim.channel import LoopbackChannel

from .executor import TorchExecutor
from .interceptor import TorchInterceptor


def loopback(state_dir: Path, mode: str = "stream", fallback: str = "local",
             memory_quota: int = 1 << 30, allow_extra: tuple[str, ...] = (),
             deny: tuple[str, ...] = (), blobs: BlobStore | None = None,
             cache_bytes: int = 1 << 30) -> TorchInterceptor:
    """An installed interceptor whose host is a ``TorchExecutor`` in this process.
    ``interceptor.session.channel.executor`` is the host; call ``uninstall()`` when done."""
    from . import make_interceptor

    ctx = ExecutorContext(
        device="auto", memory_quota=memory_quota, allow_extra=allow_extra, deny=deny,
        blobs=blobs if blobs is not None else BlobStore(Path(state_dir) / "blobs", cache_bytes),
        state_dir=Path(state_dir),
    )
    return make_interceptor(LoopbackChannel(TorchExecutor(ctx)), mode=mode, fallback=fallback)
