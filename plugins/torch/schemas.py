"""Operator schemas across torch versions: an operator runs on the host only if both ends
declare it alike.

The app and its GPU host may run different torch builds (robots run vendor builds). An
operator travels by its qualified overload name, and the same name can mean a different
operator in another version: an argument added, a default changed, a return or an alias
annotation (``Tensor(a!)``: what it writes) changed. Run with the host's meaning, such a call
gives a wrong result or fails in the middle of an inference. So the app's client sends, with
its first call of each operator in a session, a short hash of the operator's schema as the
app's torch prints it (``str(op._schema)``: name, overload name, every argument's type, alias
annotation, default and keyword-only marker, and the returns); the host compares it once with
its own and refuses the operator (``SCHEMA_MISMATCH``) when they differ. The client then runs
that operator in the app, with one warning line, or raises under ``fallback: error``.

Replays never carry the hash: a sequence the robot offers in a new session (a restarted app)
may name operators that this session never forwarded. When the two ends run different torch
versions, the host accepts a sequence only if each of its operators was compared in this
session (``require``); the refused sequence is recorded again once the app has forwarded it.
When both ends run the same torch version, schemas are equal by construction and a sequence
needs no comparison; so does a session whose app names no torch version (a client before
versions were on the wire, an in-process test): its forwarded calls are still compared.
"""

from __future__ import annotations

from typing import Any

import blake3

from rrtod.wire import BIND_OP

HASH_BYTES = 8  # a birthday collision between two schemas of one name needs ~2^32 versions


def schema_of(op: Any) -> str:
    """The schema as torch prints it: the whole signature of the overload."""
    return str(op._schema)


def schema_hash(op: Any) -> bytes:
    """What the client sends in ``OpCall.schema``."""
    return blake3.blake3(schema_of(op).encode()).digest(HASH_BYTES)


class SchemaMismatch(Exception):
    """The app declares this operator differently from the host."""


class SchemaCheck:
    """One host session's comparison of the app's schemas with the host's."""

    def __init__(self, app_versions: dict[str, str], host_versions: dict[str, str]):
        self.app_torch = app_versions.get("torch", "") or "unknown"
        self.host_torch = host_versions.get("torch", "")
        self.same_build = self.app_torch in (self.host_torch, "unknown")
        self.verified: set[str] = {BIND_OP}  # the client's own bookkeeping call: never hashed
        self.refused: dict[str, str] = {}  # name -> why, for every later call of it

    def check(self, name: str, op: Any, digest: bytes) -> None:
        """Compare the app's ``digest`` for operator ``name`` (resolved here as ``op``) with
        the host's schema; raise SchemaMismatch naming both versions and the host's schema."""
        if name in self.verified:
            return
        why = self.refused.get(name)
        if why is None:
            if digest == schema_hash(op):
                self.verified.add(name)
                return
            why = self.refused[name] = (
                f"operator {name} has a different schema in the app (torch {self.app_torch}, "
                f"schema hash {digest.hex()}) than on this host (torch {self.host_torch}: "
                f"{schema_of(op)})")
        raise SchemaMismatch(why)

    def require(self, name: str) -> None:
        """For a replayed sequence: ValueError unless ``name`` may run here without a hash."""
        if name in self.refused:
            raise ValueError(self.refused[name])
        if not self.same_build and name not in self.verified:
            raise ValueError(
                f"operator {name} has not been compared with the app's schema in this session "
                f"(app torch {self.app_torch}, host torch {self.host_torch}): the sequence "
                "is accepted once the app has forwarded it")
