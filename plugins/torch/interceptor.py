"""What the shim installs in the app: which computation is offloaded, and inference marks.

On a robot without a GPU the forward computation of the app's ``nn.Module``s is offloaded: the
first time a module is called (a global forward pre-hook, so every thread sees it), its
parameters and buffers become persistent proxies, and everything computed from them follows on
the host. Plain CPU pre-processing never touches a proxy and stays local; its results are
uploaded where they meet model compute. The outermost module call of each thread is one
inference: its start and end go to the daemon as an ``InferenceMark``.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from typing import Any

import torch
from torch import nn

from .client import RemoteSession
from .proxy import RemoteTensor


class TorchInterceptor:
    """Installed once per app process; ``uninstall`` restores plain local execution."""

    def __init__(self, session: RemoteSession):
        self.session = session
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._index = 0
        self._hooks: list[Any] = []
        self.offloaded_modules = 0
        # What is offloaded (DESIGN.md): the app's accelerator work; on a robot without one,
        # its models' forward computation. Modules are offloaded by the device of their state.
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def install(self) -> None:
        if os.environ.get("RRTO_STATS", "0") not in ("", "0"):
            atexit.register(self.print_stats)
        self._hooks.append(nn.modules.module.register_module_forward_pre_hook(self._pre))
        self._hooks.append(nn.modules.module.register_module_forward_hook(
            self._post, always_call=True))

    def uninstall(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def stats(self) -> dict[str, Any]:
        """The shim's own figures: operators seen, time spent in the shim (host waits
        included), forwarded and local calls, bytes, inferences (outermost module calls)."""
        c = dict(self.session.counters)
        out: dict[str, Any] = {k: v for k, v in c.items() if not k.endswith("_ns")}
        out.update({k[:-3] + "_s": v / 1e9 for k, v in c.items() if k.endswith("_ns")})
        out.setdefault("shim_s", 0.0)
        out["inferences"] = self._index
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
    def _pre(self, module: nn.Module, args: Any) -> None:
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        if depth == 0:
            self._tls.start = time.monotonic_ns()
        if not getattr(module, "_rrto_offloaded", False):
            self.offload(module)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        depth = getattr(self._tls, "depth", 1) - 1
        self._tls.depth = depth
        if depth == 0:
            with self._lock:
                self._index += 1
                index = self._index
            try:
                self.session.channel.mark(index, self._tls.start, time.monotonic_ns())
            except OSError:
                pass  # a lost connection is reported by the next forwarded call

    # -- offloading --------------------------------------------------------------------------
    def offload(self, module: nn.Module) -> None:
        """Turn ``module``'s (and its submodules') parameters and buffers into proxies."""
        with self._lock:
            if getattr(module, "_rrto_offloaded", False):
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
            for m in mods:
                object.__setattr__(m, "_rrto_offloaded", True)
            self.offloaded_modules += len(mods)
