"""What the shim installs in the app: which computation is offloaded, and inference marks.

On a robot without a GPU the forward computation of the app's ``nn.Module``s is offloaded: the
first time a module is called (a global forward pre-hook, so every thread sees it), its
parameters and buffers become persistent proxies, and everything computed from them follows on
the host. Plain CPU pre-processing never touches a proxy and stays local; its results are
uploaded where they meet model compute. The outermost module call of each thread is one
inference; it goes to the daemon as an ``InferenceMark`` spanning from the call to the app's last
read of its outputs. Under replay (and streaming) ``forward()`` returns proxies at once and the
app waits later, when it reads them: a mark that ended with ``forward()`` would leave that wait,
and its energy, outside the inference. So the mark waits until every tensor the call returned
has been read (or the thread starts its next inference, or the app exits), and ends with the
last read. Per inference the shim also keeps the round trips the app waited through, so a
benchmark can count those of any window of inferences (``stats()["by_inference"]``).
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
import time
import weakref
from typing import Any

import torch
from torch import nn

from rrtod.switches import SwitchError, flag

from . import compiling, factories
from .client import RemoteSession
from .here import Originals, swap_in, swap_out
from .proxy import RemoteTensor

BY_INFERENCE = ("round_trips", "push_waits", "replays", "mismatches", "switches", "cut", "resumed")


class _Open:
    """An inference whose outputs the app has not read completely yet."""

    __slots__ = ("index", "start_ns", "end_ns", "unread", "counters", "thread")

    def __init__(self, index: int, start_ns: int, end_ns: int, unread: set[int],
                 counters: tuple[int, ...], thread: int):
        self.index, self.start_ns, self.end_ns, self.unread = index, start_ns, end_ns, unread
        self.counters = counters  # the session's counters at its start (see _counters)
        self.thread = thread  # the app thread's index on the wire (``OpCall.thread``)


def _handles(value: Any, found: set[int]) -> set[int]:
    """Ids of the proxies in a module's result (tensors, lists, tuples, dicts)."""
    if isinstance(value, RemoteTensor):
        found.add(value._rrto_handle.id)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _handles(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _handles(v, found)
    return found


class TorchInterceptor:
    """Installed once per app process; ``uninstall`` restores plain local execution."""

    def __init__(self, session: RemoteSession):
        self.session = session
        self._tls = threading.local()
        self._lock = threading.Lock()
        # Modules whose tensors were made proxies. Not a mark in the module's ``__dict__``:
        # a pickled or deep-copied module carries its ``__dict__`` along, and a copy of plain
        # tensors marked offloaded would never be offloaded (it ran entirely in the app).
        self.offloaded: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._index = 0
        self._hooks: list[Any] = []
        self.offloaded_modules = 0
        # What is offloaded (docs/offloading.md): the app's accelerator work; on a robot without one,
        # its models' forward computation. Modules are offloaded by the device of their state.
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._open: dict[int, _Open] = {}  # thread id -> its inference awaiting output reads
        self._waited_ns = 0  # the replay client's search waits told to the robot so far
        # RRTO_STATS=1: per finished inference (by index), what ``_counters`` counts
        try:
            self.stats_enabled = flag("RRTO_STATS", False)
        except SwitchError:
            self.stats_enabled = False  # a diagnostic switch must not break the app
        self.by_inference: dict[int, tuple[int, ...]] = {}
        # Forwards run on the app's own tensors (``here.py``): their originals, and how many
        # threads are inside an offloaded forward (one runs here only when it is alone).
        self._originals = Originals()
        self._busy = 0

    def install(self) -> None:
        self.session.on_read = self._read
        self.session.in_forward = self._inside
        if self.stats_enabled:
            atexit.register(self.print_stats)
        atexit.register(self.close_marks)  # registered last, so it runs before print_stats
        compiling.install(self.session.warn_once)  # torch.compile runs eagerly (compiling.py)
        if flag("RRTO_HOST_FACTORIES", True):  # made on the host (factories.py)
            factories.install(self._inside, self.session.dispatch)
        self._hooks.append(nn.modules.module.register_module_forward_pre_hook(self._pre))
        self._hooks.append(nn.modules.module.register_module_forward_hook(
            self._post, always_call=True))

    def uninstall(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        compiling.uninstall()
        factories.uninstall()

    def stats(self) -> dict[str, Any]:
        """The shim's own figures: operators seen, time spent in the shim (host waits
        included), forwarded and local calls, bytes, inferences (outermost module calls)."""
        c = dict(self.session.counters)
        out: dict[str, Any] = {k: v for k, v in c.items() if not k.endswith("_ns")}
        out.update({k[:-3] + "_s": v / 1e9 for k, v in c.items() if k.endswith("_ns")})
        out.setdefault("shim_s", 0.0)
        out["inferences"] = self._index
        by = sorted(self.by_inference.items())
        out["by_inference"] = {"index": [i for i, _ in by],
                               **{k: [row[j] for _, row in by] for j, k in enumerate(BY_INFERENCE)}}
        out["mode"] = self.session.mode
        replayer = getattr(self.session, "replay", None)
        if replayer is not None and isinstance(getattr(replayer, "counters", None), dict):
            out.update({f"replay_{k}" if k in out else k: v
                        for k, v in replayer.counters.items()})
        return out

    def print_stats(self) -> None:
        """``RRTO_STATS=1``: one ``rrto-stats {json}`` line on stderr at exit (bench harness)."""
        print("rrto-stats " + json.dumps(self.stats(), default=str), file=sys.stderr,
              flush=True)

    # -- hooks -------------------------------------------------------------------------------
    def _inside(self) -> bool:
        """This thread is inside an offloaded module's forward, and the host is there (not
        one the robot runs whole: its factories make local tensors)."""
        return (getattr(self._tls, "depth", 0) > 0 and self.session.lost is None
                and getattr(self._tls, "here", None) is None)

    def _pre(self, module: nn.Module, args: Any) -> None:
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        if depth == 0:
            with self._lock:
                self._busy += 1
            self._begin()
            if module in self.offloaded:
                self._tls.here = self._here(module)
        if module not in self.offloaded:
            self.offload(module)

    def _here(self, module: nn.Module) -> list[Any] | None:
        """Run this inference on the app's own tensors if the scheduler placed all of it on
        the robot (``ReplayClient.runs_here``) and no other thread is in a forward (the swap
        is the module's, not the thread's): the swapped slots, else None."""
        replay = getattr(self.session, "replay", None)
        if replay is None or self._busy != 1 or self.session.lost is not None:
            return None
        plan = replay.runs_here(self.session.thread_index())
        if plan is None:
            return None
        slots = swap_in(module, self.session, self._originals)
        if slots is not None:
            replay.ran_here(plan)
        return slots

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        depth = getattr(self._tls, "depth", 1) - 1
        self._tls.depth = depth
        if depth == 0:
            here = getattr(self._tls, "here", None)
            if here is not None:
                self._tls.here = None
                swap_out(here, self.session)
            end = time.monotonic_ns()
            with self._lock:
                self._busy -= 1
                self._index += 1
                index = self._index
            open_ = _Open(index, self._tls.start, end, _handles(output, set()),
                          self._tls.counters, self.session.thread_index())
            if open_.unread:
                self._open[threading.get_ident()] = open_
            else:
                self._close(open_)

    # -- inference marks -----------------------------------------------------------------------
    def _begin(self) -> None:
        """A thread's outermost module call: its previous inference, if still open, ends with
        the last read the app made of it (it never read some of its outputs)."""
        open_ = self._open.pop(threading.get_ident(), None)
        if open_ is not None:
            self._close(open_)
        self._tls.counters = self._counters()
        self._tls.start = time.monotonic_ns()
        self.session.inference_started()

    def _counters(self) -> tuple[int, ...]:
        """The session's counts that ``stats()["by_inference"]`` gives per inference
        (``BY_INFERENCE``): replies the app waited for (a replayed inference's pushed outputs
        are one), the waits among them for pushed outputs, replays started, replays that
        mismatched, switches to a variant at a branch, loops cut at a branch no variant has,
        and loops resumed after one."""
        c = self.session.counters
        replay = getattr(self.session, "replay", None)
        rc = replay.counters if replay is not None else {}
        return (c["round_trips"] + c["replay_replies"], c["push_waits"], rc.get("replays", 0),
                rc.get("mismatches", 0), rc.get("switches", 0), rc.get("cut", 0),
                rc.get("resumed", 0))

    def _read(self, handle_id: int) -> None:
        """The app read a proxy (``RemoteSession.download``): extends its thread's open
        inference to now; the read of the last unread output closes it."""
        open_ = self._open.get(threading.get_ident())
        if open_ is None:
            return
        open_.end_ns = time.monotonic_ns()
        open_.unread.discard(handle_id)
        if not open_.unread:
            del self._open[threading.get_ident()]
            self._close(open_)

    def _close(self, open_: _Open, own: bool = True) -> None:
        """``open_`` ends: its mark goes to the robot daemon. ``own``: it is this thread's
        inference (not one left open at exit), whose lane another thread may now take."""
        if self.stats_enabled:
            self.by_inference[open_.index] = tuple(
                now - then for now, then in zip(self._counters(), open_.counters, strict=True))
        replay = getattr(self.session, "replay", None)
        waited = replay.counters["search_wait_ns"] if replay is not None else 0
        with self._lock:
            waited, self._waited_ns = waited - self._waited_ns, waited
        channel = self.session.channel
        # (a channel that does not say it answers such a mark, a wrapper's, is not waited on)
        left = (replay is not None and getattr(channel, "answers_marks", False)
                and replay.left_inference())
        if left:  # the robot may search for the way it went: the next start waits to hear
            replay.await_answer()
        try:
            channel.mark(open_.index, open_.start_ns, open_.end_ns, thread=open_.thread,
                         search_wait_us=max(0, waited) // 1000,
                         **({"left_replay": True} if left else {}))
        except OSError:
            pass  # a lost connection is reported by the next forwarded call
        ended = getattr(self.session, "inference_ended", None) if own else None
        if ended is not None:
            ended()

    def close_marks(self) -> None:
        """At exit: inferences whose outputs were not all read end with their last read."""
        while self._open:
            _, open_ = self._open.popitem()
            self._close(open_, own=False)
        try:
            self.session.channel.flush_marks()  # the helper thread does not outlive exit
        except (OSError, AttributeError):
            pass

    # -- offloading --------------------------------------------------------------------------
    def offload(self, module: nn.Module) -> None:
        """Turn ``module``'s (and its submodules') parameters and buffers into proxies."""
        with self._lock:
            if module in self.offloaded:
                return
            mods = list(module.modules())
            slots: list[tuple[dict, str, torch.Tensor, bool]] = []
            seen: dict[int, int] = {}
            uniq: list[torch.Tensor] = []
            for m in mods:
                for table, is_param in ((m._parameters, True), (m._buffers, False)):
                    for name, t in table.items():
                        if (t is None or isinstance(t, RemoteTensor)
                                or t.device.type != self.device_type):
                            continue
                        if t.layout != torch.strided or t.is_quantized:
                            continue
                        if id(t) not in seen:  # tied weights stay tied
                            seen[id(t)] = len(uniq)
                            uniq.append(t)
                        slots.append((table, name, t, is_param))
            proxies = self.session.persist(uniq) if uniq else []
            made: dict[int, torch.Tensor] = {}
            for table, name, t, is_param in slots:
                new = made.get(id(t))
                if new is None:
                    p = proxies[seen[id(t)]]
                    new = nn.Parameter(p, requires_grad=t.requires_grad) if is_param else p
                    made[id(t)] = new
                table[name] = new
            self.offloaded.update(mods)
            self.offloaded_modules += len(mods)
