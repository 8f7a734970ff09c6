"""Which operators a host will run, resolved by qualified overload name only.

Operators never travel as code: the app names one (``aten::add.Tensor``) and the host looks the
name up here. The built-in list is every ``aten`` overload registered with the dispatcher whose
arguments are plain data (tensors, numbers, strings, devices, dtypes), minus operators with side
effects outside the session (files, printing, raw storages, streams, process-global caches).
Other namespaces (``torchvision::nms``, an app's ``torch.library`` ops) are allowed only when the
host's ``executor.allow_extra`` names them; ``executor.deny`` removes names. Entries are either a
full overload name (``ns::op.overload``) or an operator name covering all overloads (``ns::op``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

# Base names (no overload) never allowed, whatever the configuration says about aten.
BUILTIN_DENY: frozenset[str] = frozenset(
    {
        "aten::from_file",  # reads a file on the host
        "aten::save",
        "aten::_print",  # writes to the host's stdout
        "aten::set_",  # rebinds raw storages
        "aten::set",
        "aten::set_data",
        "aten::record_stream",
        "aten::_cufft_set_plan_cache_max_size",  # process-global state
        "aten::_cufft_clear_plan_cache",
        "aten::_sleep",
    }
)

# Argument types that carry only data. Anything else (Storage, Stream, Any, Dict, classes) is out.
_SAFE_TYPE = re.compile(
    r"^(Optional\[)?(List\[)?(Optional\[)?"
    r"(Tensor|int|float|bool|str|complex|number|Device|ScalarType|Layout|MemoryFormat|Generator|SymInt)"
    r"\]*$"
)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


class OpNotAllowed(Exception):
    """The operator is not on this host's allowlist (or does not exist here)."""


def split(name: str) -> tuple[str, str, str]:
    """``ns::op.overload`` -> (ns, op, overload); overload ``default`` when absent."""
    ns, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    return ns, op, overload or "default"


def _lookup(name: str) -> torch._ops.OpOverload | None:
    """The OpOverload for an exact, syntactically valid name, without importing anything."""
    ns, op, overload = split(name)
    dispatcher_name = f"{ns}::{op}" + ("" if overload == "default" else f".{overload}")
    if not torch._C._dispatch_has_kernel(dispatcher_name) and not _registered(dispatcher_name):
        return None
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None


def _registered(dispatcher_name: str) -> bool:
    try:
        return dispatcher_name in _all_names()
    except RuntimeError:
        return False


_ALL: frozenset[str] | None = None


def _all_names() -> frozenset[str]:
    global _ALL
    if _ALL is None or len(_ALL) != len(torch._C._dispatch_get_all_op_names()):
        _ALL = frozenset(torch._C._dispatch_get_all_op_names())
    return _ALL


def _safe_schema(op: torch._ops.OpOverload) -> bool:
    for arg in op._schema.arguments:
        if not _SAFE_TYPE.match(str(arg.type)):
            return False
        if str(arg.type).endswith("Generator") and "Optional" not in str(arg.type):
            return False
    return True


class Allowlist:
    """Resolves names to operators for one host configuration; caches each decision."""

    def __init__(self, allow_extra: Iterable[str] = (), deny: Iterable[str] = ()):
        self.allow_extra = frozenset(allow_extra)
        self.deny = frozenset(deny) | BUILTIN_DENY
        self._cache: dict[str, torch._ops.OpOverload | str] = {}

    def _listed(self, names: frozenset[str], name: str) -> bool:
        base = name.split(".", 1)[0]
        return name in names or base in names

    def resolve(self, name: str) -> torch._ops.OpOverload:
        """The operator named ``name``; raises OpNotAllowed saying why not."""
        hit = self._cache.get(name)
        if hit is None:
            hit = self._decide(name)
            if len(self._cache) < 100_000:
                self._cache[name] = hit
        if isinstance(hit, str):
            raise OpNotAllowed(hit)
        return hit

    def _decide(self, name: str) -> torch._ops.OpOverload | str:
        if not _NAME.match(name):
            return f"{name[:200]!r} is not a qualified operator name"
        if self._listed(self.deny, name):
            return f"operator {name} is denied on this host"
        extra = self._listed(self.allow_extra, name)
        if not name.startswith("aten::") and not extra:
            return (f"operator {name} is not allowed on this host "
                    "(add it to executor.allow_extra to forward it)")
        op = _lookup(name)
        if op is None:
            return f"operator {name} does not exist on this host"
        if not extra and not _safe_schema(op):
            return f"operator {name} takes arguments that cannot be forwarded safely"
        return op

    def allows(self, name: str) -> bool:
        try:
            self.resolve(name)
        except OpNotAllowed:
            return False
        return True


def builtin_names() -> list[str]:
    """Every operator overload the built-in allowlist admits (for docs and `rrtoctl`)."""
    allow = Allowlist()
    out = []
    for name in sorted(_all_names()):
        if name.startswith("aten::"):
            full = name if "." in name else name + ".default"
            if allow.allows(full):
                out.append(full)
    return out
