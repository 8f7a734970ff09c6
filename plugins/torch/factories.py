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

``torch.tensor`` and ``torch.as_tensor`` of Python numbers (``DATA_FACTORIES``) follow the same
rule when the call names a ``device``: ``torch.as_tensor(self.image_mean, device=image.device)``
is made to meet the model's tensors. Made in the app, torchvision's detection transform
normalised and resized the image there, and SSDlite uploaded its 320x320 result, six times the
app's input. Such a tensor is made in the app and copied to the host by one forwarded ``clone``
(its bytes are the same every inference, so a sequence carries them: ``SeqSource.fixed``). One
made without a device (``torch.tensor(image.shape[-2:])``, read back at once with ``.item()``)
is a helper of the Python code and stays local: as a proxy, each read would be a round trip.
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
DATA_FACTORIES = ("tensor", "as_tensor")
# Python data a data factory sends to the host: numbers, nested at most this deep in lists and
# tuples, at most this many in all (a larger literal is not a model's constant).
_MAX_DEPTH, _MAX_ITEMS = 4, 4096
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
    for name in DATA_FACTORIES:
        original = getattr(torch, name)
        _originals[name] = original
        setattr(torch, name, _wrap_data(original, inside, dispatch))


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


def _wrap_data(original: Callable[..., Any], inside: Callable[[], bool],
               dispatch: Callable[[Any, tuple, dict], Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def factory(data: Any, *args: Any, **kwargs: Any) -> Any:
        made = original(data, *args, **kwargs)
        if not inside() or kwargs.get("device") is None or kwargs.get("requires_grad") \
                or kwargs.get("pin_memory") or _device_type(kwargs["device"]) == "meta" \
                or not _python_numbers(data, 0, [0]) or _ours(sys._getframe(1)):
            return made
        return dispatch(torch.ops.aten.clone.default, (made,), {})
    return factory


def _python_numbers(data: Any, depth: int, seen: list[int]) -> bool:
    """``data`` is Python numbers (bool, int, float), in lists and tuples at most
    ``_MAX_DEPTH`` deep, ``_MAX_ITEMS`` in all: never a tensor, an array or anything else."""
    seen[0] += 1
    if seen[0] > _MAX_ITEMS:
        return False
    if isinstance(data, (bool, int, float)):
        return True
    if isinstance(data, (list, tuple)) and depth < _MAX_DEPTH:
        return all(_python_numbers(x, depth + 1, seen) for x in data)
    return False


def _ours(frame: Any) -> bool:
    """The caller is the shim itself (decoding a downloaded value): never the host's."""
    return frame.f_globals.get("__name__", "").startswith(_OWN)


def _device_type(device: Any) -> str | None:
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":")[0]
