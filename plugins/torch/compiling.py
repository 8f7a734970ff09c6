"""``torch.compile`` under the shim: the compiled region runs eagerly, its operators offloaded.

TorchDynamo traces a region by running it on fake tensors made from its inputs and from the
module's state. An offloaded module's state is proxies (``RemoteTensor``: storage-less, their
values on the GPU host), which Dynamo cannot fake: the app crashed on its first compiled call
with ``InternalTorchDynamoError: `tensor` needs to be a `FakeTensor```. A traced graph would also
run its operators in the app, not through the shim. So while offloading is installed,
``torch.compile`` (and ``nn.Module.compile``, which calls it) returns its target unchanged and
prints one warning line naming the pattern: the app runs on, with eager semantics (its outputs
equal those of its eager run), and the region's operators go to the GPU host like any others.
Compiling for the host's device would pay only there, and would need the graph on the wire.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

PATTERN = "torch.compile"
_original: Callable[..., Any] | None = None


def install(warn_once: Callable[[str, str], None]) -> None:
    """Replace ``torch.compile`` by one that warns (``warn_once(key, message)``) and returns
    its target; idempotent. ``uninstall`` puts the original back."""
    global _original
    if _original is not None:
        return
    _original = torch.compile

    @functools.wraps(_original)
    def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:  # noqa: A001
        if model is None:  # @torch.compile(mode=...): a decorator
            return lambda target: compile(target, *args, **kwargs)
        warn_once(PATTERN, f"torch.compile({_name(model)}) runs uncompiled (eagerly): "
                           "TorchDynamo cannot trace the offloaded tensors, so its operators "
                           "run on the GPU host one by one, as without torch.compile")
        return model

    torch.compile = compile


def uninstall() -> None:
    global _original
    if _original is not None:
        torch.compile = _original
        _original = None


def _name(target: Any) -> str:
    if isinstance(target, torch.nn.Module):
        return type(target).__name__
    func = getattr(target, "__func__", target)  # a bound method (nn.Module.compile's _call_impl)
    owner = getattr(target, "__self__", None)
    name = getattr(func, "__qualname__", None) or type(target).__name__
    return f"{type(owner).__name__}.{func.__name__}" if isinstance(owner, torch.nn.Module) \
        else name
