"""Keep Python's cyclic garbage collector away from objects that live as long as the process.

A full collection (generation 2) walks every object the collector tracks, holding the GIL, so
every thread of the process stops meanwhile. A GPU daemon with torch and its plugins imported
tracks ~400 000 objects: 90-200 ms a full collection, six of them while a detector recorded
(``gc.callbacks``, 2026-11-28). An app tracks its model and libraries too, and the shim's
per-call objects trigger the collections: one 148 ms pause every ~20 inferences of yolo-pose,
charged to whichever replayed call allocated (its shim time a call 31 us against 21 us with
this). ``gc.freeze()`` moves every object alive now into a permanent generation that
collections skip; objects made later are collected as before, and frozen ones are still freed
by reference counting when their last reference goes. Only a reference cycle among frozen
objects that becomes garbage later is left until the next ``settle``, which first thaws and
collects everything.

The daemon settles once it has started (its modules, plugins and roles are what it keeps); the
shim when the app begins its second inference, having read the first's outputs (its model and
libraries are loaded by then), and again at a later definition - a new model, a new variant -
at most once a minute. A GPU daemon imports torch and its executor only when the first app
connects, after its start: it settles as it makes that session's executor whatever the interval
(``once``), at later sessions' and at definitions at most once a minute. Neither settles at the
first definition: a settle there (180-190 ms for a resnet50 app, on each end) held the answer
back while the app's third inference ran forwarded. Unsettled, a Mask R-CNN host walked
440 000 objects (torch's, and the compiled sequences') in each of 14 full collections over 40
frames, 85-95 ms each.
``RRTO_GC_FREEZE=0`` leaves the collector as Python sets it.
"""

from __future__ import annotations

import gc
import threading
import time

from rrtod.switches import flag

MIN_INTERVAL_S = 60.0  # between settles after the first: each is one full collection

_lock = threading.Lock()
_last: float | None = None
_once: set[str] = set()  # the ``once`` reasons settled for


def settle(again: bool = False, once: str | None = None) -> bool:
    """Collect every cycle that is garbage now, then freeze what is left. The first call
    settles; later ones only with ``again`` and ``MIN_INTERVAL_S`` after the previous one, or
    the first time a ``once`` reason is given. Whether it settled."""
    global _last
    if not flag("RRTO_GC_FREEZE", True):
        return False
    with _lock:
        now = time.monotonic()
        first = once is not None and once not in _once
        if _last is not None and not first and (not again or now - _last < MIN_INTERVAL_S):
            return False
        _last = now
        if once is not None:
            _once.add(once)
    gc.unfreeze()  # what an earlier settle froze is looked at once more: cycles dropped since
    gc.collect()
    gc.freeze()
    return True
