"""Runs at interpreter start when offloading is on; defers all real work to ``import torch``.

Only the standard library is imported here: this module is loaded by every Python process that
has ``RRTO_OFFLOAD=1`` in its environment, including ones that never touch torch.
"""

from __future__ import annotations

import os
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from importlib.util import module_from_spec, spec_from_file_location
from typing import Any

_installed = False


def _switches() -> Any:
    """``rrtod.switches`` (the one parser of every switch), loaded by its path as site.py loads
    this module, so that a program that never imports torch does not pay for the package."""
    mod = sys.modules.get("rrtod.switches")
    if mod is None:
        spec = spec_from_file_location(
            "rrtod.switches", os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                           "switches.py"))
        assert spec is not None and spec.loader is not None
        mod = module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def enabled() -> bool:
    """``RRTO_OFFLOAD`` as every other reader parses it; a value that is neither true nor false
    leaves the app local (with one line saying why) rather than failing its start."""
    switches = _switches()
    try:
        return bool(switches.flag("RRTO_OFFLOAD", False))
    except switches.SwitchError as exc:
        print(f"rrto: warning: {exc}; running locally", file=sys.stderr)
        return False


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
