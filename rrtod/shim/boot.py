"""Runs at interpreter start when offloading is on; defers all real work to ``import torch``.

Only the standard library is imported here: this module is loaded by every Python process that
has ``RRTO_OFFLOAD=1`` in its environment, including ones that never touch torch.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any

_installed = False


def enabled() -> bool:
    return os.environ.get("RRTO_OFFLOAD", "0").strip().lower() not in ("", "0", "false", "no", "off")


def _after_torch() -> None:
    try:
        from rrtod.shim.activate import activate
    except Exception as exc:  # a broken install must never break the app
        print(f"rrto: warning: offloading unavailable ({exc!r}); running locally",
              file=sys.stderr)
        return
    activate()


class _TorchWatcher(MetaPathFinder):
    """Finds nothing itself: wraps the real loader of ``torch`` to run activation after it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot; also avoids recursion below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            _after_torch()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Activate now if torch is already imported, else when it is."""
    global _installed
    if _installed or not enabled():
        return
    _installed = True
    if "torch" in sys.modules:
        _after_torch()
    else:
        sys.meta_path.insert(0, _TorchWatcher())
