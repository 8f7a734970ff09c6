"""The ``torch`` interception backend: offload PyTorch operators of an unmodified app.

Client side (in the app, built by the shim): ``make_interceptor`` wraps a channel to the robot
daemon in a ``RemoteSession`` and installs the module hooks that turn model state into proxies.
Host side (in the GPU daemon): ``make_executor`` builds a ``TorchExecutor`` per session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rrtod.hookspecs import InterceptionBackend, hookimpl

if TYPE_CHECKING:
    from rrto.v1.ops_pb2 import OpCall
    from rrtod.executor import ExecutorContext
    from rrtod.hookspecs import Channel

    from .allowlist import BuiltinEntry
    from .executor import TorchExecutor
    from .interceptor import TorchInterceptor


def make_interceptor(channel: Channel, mode: str = "stream", fallback: str = "local",
                     replay: bool = True, deadline_ms: float | None = None) -> TorchInterceptor:
    """``InterceptionBackend.factory`` (``rrtod.hookspecs.InterceptorFactory``): the shim calls
    it once torch is imported."""
    from .client import RemoteSession
    from .interceptor import TorchInterceptor

    interceptor = TorchInterceptor(RemoteSession(channel, mode=mode, fallback=fallback,
                                                 replay=replay, deadline_ms=deadline_ms))
    interceptor.install()
    return interceptor


def make_executor(ctx: ExecutorContext) -> TorchExecutor:
    """``InterceptionBackend.executor`` (``rrtod.hookspecs.ExecutorFactory``): one
    ``TorchExecutor`` per app session on the host."""
    from .executor import TorchExecutor

    return TorchExecutor(ctx)


def builtin_operators() -> list[BuiltinEntry]:
    """``InterceptionBackend.operators``: the positive allowlist with each entry's reasons."""
    from .allowlist import builtin_entries

    return list(builtin_entries().values())


def framework_versions() -> dict[str, str]:
    """``InterceptionBackend.versions``: the torch this process runs (in the app, the app's;
    on the host, the executor's)."""
    import torch

    return {"torch": torch.__version__}


def call_aliasing() -> tuple[Callable[[OpCall], list[int] | None],
                             Callable[[OpCall], list[int] | None]]:
    """``InterceptionBackend.aliasing``: what a recorded call writes in place and what its
    outputs view, from its operator's schema (None for an operator torch does not have)."""
    from . import aliasing
    from .allowlist import lookup

    def written(call: OpCall) -> list[int] | None:
        op = lookup(call.op)
        return None if op is None else aliasing.written_ids(op, call)

    def viewed(call: OpCall) -> list[int] | None:
        op = lookup(call.op)
        return None if op is None else aliasing.viewed_ids(op, call)

    return written, viewed


def call_rows() -> Callable[..., Any]:
    """``InterceptionBackend.rows``: a recorded call as a local operator (``rows.rule``)."""
    from . import rows

    return rows.rule


@hookimpl
def rrto_interception_backends() -> list[InterceptionBackend]:
    return [
        InterceptionBackend(
            name="torch",
            factory=make_interceptor,
            executor=make_executor,
            operators=builtin_operators,
            versions=framework_versions,
            aliasing=call_aliasing,
            rows=call_rows,
            description="PyTorch: forwards every aten operator of an app's models to a GPU host",
        )
    ]
