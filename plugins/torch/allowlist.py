"""Which operators a host will run, resolved by qualified overload name only.

Operators never travel as code: the app names one (``aten::add.Tensor``) and the host looks the
name up here. The built-in list is *positive*: the operator overloads that real inference models
send (``allowlist_ops.txt`` beside this module, derived by ``python -m bench.oplist`` from the
correctness suite, the benchmark and a wide set of torchvision/timm/transformers models under
each grad mode; docs/allowlist.md says how), each with a reason class. Anything else is refused
unless the host's ``executor.allow_extra`` names it (``ns::op.overload``, ``ns::op`` for all
overloads, ``ns::*`` for a namespace). Internal or unsafe operators (``rrtod/opnames.py``: views
of any size, unchecked indexing, raw storages, files, nested/mkldnn/sparse internals) are refused
even then, unless the entry is marked ``unsafe:``. ``executor.deny`` removes names. Operators the
list or a namespace entry admits must also take only plain data (tensors, numbers, strings,
devices, dtypes); an operator named explicitly in ``allow_extra`` is the operator's own choice.
Operators of other libraries (``torchvision::nms``) are admitted by the reviewed table in
``libops.py`` when the host has the library (its import is probed), with their input guards.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from rrtod.opnames import is_name, parse_entry, split, unsafe_reason

from . import libops

__all__ = ["Allowlist", "BuiltinEntry", "OpNotAllowed", "builtin_entries", "builtin_names",
           "split"]

LIST_PATH = Path(__file__).with_name("allowlist_ops.txt")

# Argument types that carry only data. Anything else (Storage, Stream, Any, Dict, classes) is out.
_SAFE_TYPE = re.compile(
    r"^(Optional\[)?(List\[)?(Optional\[)?"
    r"(Tensor|int|float|bool|str|complex|number|Device|ScalarType|Layout|MemoryFormat|Generator|SymInt)"
    r"\]*$"
)


# Creation operators whose outputs hold whatever the allocator held before: on CUDA the caching
# allocator hands out blocks another session freed (its camera frames, its activations). The host
# zeroes their outputs before anyone can read them.
UNINITIALIZED: frozenset[str] = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)


class ZeroFilled:
    """An uninitialized-creation operator whose tensor outputs start zeroed. Behaves as the
    OpOverload it wraps (schema, name) for the executor."""

    __slots__ = ("op",)

    def __init__(self, op: torch._ops.OpOverload):
        self.op = op

    def __getattr__(self, name: str) -> object:
        return getattr(self.op, name)

    def __call__(self, *args: object, **kwargs: object) -> object:
        out = self.op(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                # an inference tensor may be written only in inference mode, a leaf that
                # requires grad only without autograd
                with torch.inference_mode() if t.is_inference() else torch.no_grad():
                    t.zero_()
        return out


class OpNotAllowed(Exception):
    """The operator is not on this host's allowlist (or does not exist here)."""


@dataclass(frozen=True)
class BuiltinEntry:
    """One line of the built-in list: why an inference model needs the operator."""

    name: str  # ns::op.overload
    reason: str  # reason class, e.g. "conv/matmul"
    modes: str  # grad modes it was seen under
    seen_in: str  # model families it was seen in


@cache
def builtin_entries() -> dict[str, BuiltinEntry]:
    """The committed positive list, by full overload name."""
    out: dict[str, BuiltinEntry] = {}
    for line in LIST_PATH.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, reason, modes, seen = (line.split() + ["", "", ""])[:4]
        out[name] = BuiltinEntry(name, reason, modes, seen)
    return out


_FOUND: dict[str, torch._ops.OpOverload] = {}  # names found (one not found may be later)


def lookup(name: str) -> torch._ops.OpOverload | None:
    """The OpOverload for an exact, syntactically valid name, without importing anything.
    Found ones are kept: an operator with no kernel of its own (a composite) is otherwise
    looked up in the list of every registered name, 3 ms a time (a replayed sequence of
    5 000 calls is compiled with a lookup per call)."""
    found = _FOUND.get(name)
    if found is not None:
        return found
    ns, op, overload = split(name)
    dispatcher_name = f"{ns}::{op}" + ("" if overload == "default" else f".{overload}")
    if not torch._C._dispatch_has_kernel(dispatcher_name) and not _registered(dispatcher_name):
        return None
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        found = _FOUND[name] = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None
    return found


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


def _covers(entries: frozenset[str], name: str) -> bool:
    """``entries`` name ``name`` exactly, by operator (all overloads) or by namespace."""
    return (name in entries or name.split(".", 1)[0] in entries
            or name.split("::", 1)[0] + "::*" in entries)


class Allowlist:
    """Resolves names to operators for one host configuration; caches each decision."""

    def __init__(self, allow_extra: Iterable[str] = (), deny: Iterable[str] = ()):
        parsed = [parse_entry(e) for e in allow_extra]
        self.allow_extra = frozenset(n for n, marked in parsed if not marked)
        self.allow_unsafe = frozenset(n for n, marked in parsed if marked)
        self.deny = frozenset(deny)
        self.builtin = builtin_entries()
        self._cache: dict[str, Any] = {}

    def resolve(self, name: str) -> Any:
        """The operator named ``name``; raises OpNotAllowed saying why not."""
        hit = self._cache.get(name)
        if hit is None:
            hit = self._decide(name)
            if len(self._cache) < 100_000:
                self._cache[name] = hit
        if isinstance(hit, str):
            raise OpNotAllowed(hit)
        return hit

    def _decide(self, name: str) -> Any:
        if not is_name(name):
            return f"{name[:200]!r} is not a qualified operator name"
        if _covers(self.deny, name):
            return f"operator {name} is denied on this host"
        ns, op_name, overload = split(name)
        full = f"{ns}::{op_name}.{overload}"
        library = libops.entry(full)
        why = unsafe_reason(full)
        if why is not None:
            if not _covers(self.allow_unsafe, full):
                return (f"operator {name} is internal or unsafe ({why}); refused (a host "
                        f"enables it only with executor.allow_extra: ['unsafe:{ns}::{op_name}'])")
            explicit = True
        else:
            explicit = (full in self.allow_extra or f"{ns}::{op_name}" in self.allow_extra)
            if (not explicit and full not in self.builtin and library is None
                    and not _covers(self.allow_extra, full)):
                return (f"operator {name} is not on this host's allowlist (no inference model "
                        "needs it; executor.allow_extra adds it)")
        missing = libops.probe(ns)  # a reviewed library's operators exist once it is imported
        if missing is not None:
            return f"operator {name} cannot run here: {missing}"
        op = lookup(full)
        if op is None:
            return f"operator {name} does not exist on this host"
        if not explicit and not _safe_schema(op):
            return f"operator {name} takes arguments that cannot be forwarded safely"
        if library is not None:
            return libops.guarded(op, library)
        return ZeroFilled(op) if op_name in UNINITIALIZED else op

    def allows(self, name: str) -> bool:
        try:
            self.resolve(name)
        except OpNotAllowed:
            return False
        return True


def builtin_names() -> list[str]:
    """Every operator overload the built-in allowlist admits on this host (docs, `rrtoctl`)."""
    allow = Allowlist()
    return sorted(n for n in builtin_entries() if allow.allows(n))
