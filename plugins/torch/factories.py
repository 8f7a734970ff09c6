"""Tensors a model creates inside its forward are made on the GPU host.

Everything computed from an offloaded module's state follows on the host, but a tensor created
from nothing (``torch.zeros((n, c, 7, 7), device=x.device)``, ``torch.arange(w, device=...)``)
has no proxy among its arguments: made in the app, it was uploaded where it met the model, and
an in-place write of host values into it (``result[idx] = roi_align(...)``, torchvision's
``MultiScaleRoIAlign``) ran in the app, downloading the values first. For a Faster R-CNN that was
26 MB on the wire per inference, for a zero-filled buffer. So while a thread is inside an
offloaded module's ``forward`` (``inside()``), the deterministic factories below create proxies:
the call goes to the host like any operator (and is part of a recorded sequence, its sizes
symbolic when they follow the data). Outside a forward (the app's own pre- and post-processing)
they stay local. Random factories (``randn``, ``rand``) always stay local: the host's generator
is not the app's, and outputs must equal local execution. ``RRTO_HOST_FACTORIES=0`` keeps every
factory in the app (an app that writes into such a tensor through ``.numpy()`` inside its
forward needs it: a proxy's ``numpy()`` is a copy).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_OWN = ("rrto_plugins.", "rrtod.")  # the shim's own modules
FACTORIES = ("zeros", "ones", "empty", "full", "arange", "linspace", "eye", "empty_strided")
_originals: dict[str, Callable[..., Any]] = {}


class _OnHost(TorchDispatchMode):
    """Sends a call with no tensor argument (the factory itself) through the session; calls
    on tensors (a decomposition's ``fill_`` on the new proxy) dispatch as usual."""

    def __init__(self, dispatch: Callable[[Any, tuple, dict], Any]):
        super().__init__()
        self.dispatch = dispatch

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            return func(*args, **kwargs)
        return self.dispatch(func, args, kwargs)


def install(inside: Callable[[], bool], dispatch: Callable[[Any, tuple, dict], Any]) -> None:
    """Wrap the factories: ``inside()`` says whether this thread is in an offloaded forward,
    ``dispatch(func, args, kwargs)`` runs an operator through the session. Idempotent."""
    if _originals:
        return
    for name in FACTORIES:
        original = getattr(torch, name)
        _originals[name] = original
        setattr(torch, name, _wrap(original, inside, dispatch))


def uninstall() -> None:
    for name, original in _originals.items():
        setattr(torch, name, original)
    _originals.clear()


def _wrap(original: Callable[..., Any], inside: Callable[[], bool],
          dispatch: Callable[[Any, tuple, dict], Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if not inside() or _ours(sys._getframe(1)) or kwargs.get("out") is not None \
                or kwargs.get("requires_grad") or kwargs.get("pin_memory") \
                or _device_type(kwargs.get("device")) == "meta":
            return original(*args, **kwargs)
        with _OnHost(dispatch):
            return original(*args, **kwargs)
    return factory


def _ours(frame: Any) -> bool:
    """The caller is the shim itself (decoding a downloaded value): never the host's."""
    return frame.f_globals.get("__name__", "").startswith(_OWN)


def _device_type(device: Any) -> str | None:
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":")[0]
