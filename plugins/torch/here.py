"""An offloaded module's forward run on the app's own tensors, nothing intercepted.

When the scheduler places every call of an inference on the robot (``ReplayClient.runs_here``),
matching each call against the sequence only to run it here costs the shim's Python per call
(~0.3 ms beside the operator: resnet18 100 ms against 77 ms local). Instead, for that one
forward, the module's parameters and buffers are its original tensors again (the app's copies
the proxies keep, ``Handle.local``), and put back when the forward returns or raises.

Nothing can differ from local execution, since it is local execution. What must not be lost is
the host's view of the weights. A forward that writes one of them in place leaves the host's
copy older: that tensor is marked ``diverged`` (its value goes with the next call that names it,
and replay does not bind the host's copy). Writes are seen by the tensors' version counters,
which a kernel's own writes do not bump (batch norm's running statistics in training: measured),
so a module tree with any module in training mode never runs here.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from .proxy import RemoteTensor
from .session_api import Session

# (table, name, proxy, original put in its place, the proxy's handle, the original's version)
Slot = tuple[dict[str, Any], str, torch.Tensor, torch.Tensor, Any, int]


class Originals:
    """Per module, where its proxies are and the app's original tensor for each, as the
    module holds it (a parameter as a parameter): found once, checked at each use."""

    def __init__(self) -> None:
        # module -> [(table, name, proxy, its handle, the original as put in its place)]
        self._slots: weakref.WeakKeyDictionary[nn.Module, list[tuple[Any, ...]]] = \
            weakref.WeakKeyDictionary()

    def slots(self, module: nn.Module) -> list[tuple[Any, ...]] | None:
        known = self._slots.get(module)
        if known is not None and all(table.get(name) is proxy and h.local is local
                                     for table, name, proxy, h, local, _made in known):
            return known
        found = []
        for m in module.modules():
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if not isinstance(t, RemoteTensor):
                        continue
                    h = t._rrto_handle
                    local = h.local
                    if local is None or tuple(local.shape) != tuple(t.shape) \
                            or local.stride() != t.stride():
                        return None
                    made = (nn.Parameter(local, requires_grad=t.requires_grad)
                            if isinstance(t, nn.Parameter) else local)
                    found.append((table, name, t, h, local, made))
        self._slots[module] = found
        return found


def swap_in(module: nn.Module, session: Session, originals: Originals) -> list[Slot] | None:
    """Put the originals in place of ``module``'s proxies (its submodules' too). None, with
    nothing changed, if one has no current original (written on the host since, or never kept)."""
    if any(m.training for m in module.modules()):
        return None  # (its writes may not show in the version counters)
    known = originals.slots(module)
    if known is None:
        return None
    diverged = session.diverged
    for _table, _name, _proxy, h, _local, _made in known:
        if not session.local_is_current(h) or (diverged and h.id in diverged):
            return None
    slots: list[Slot] = []
    for table, name, proxy, h, _local, made in known:
        table[name] = made
        slots.append((table, name, proxy, made, h, made._version))
    return slots


def swap_out(slots: list[Slot], session: Session) -> None:
    """Put the proxies back; an original the forward wrote leaves the host's copy older."""
    for table, name, proxy, made, h, version in slots:
        if table.get(name) is made:
            table[name] = proxy
        if made._version != version:
            session.diverged.add(h.id)
