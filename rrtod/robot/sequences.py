"""Saved inference operator sequences in the robot daemon's state directory: the one module that
reads and writes their files.

One JSON document per sequence under ``<state_dir>/sequences/``, named
``<app slug>-<fingerprint>-t<thread>.json`` (the app's file name, the content hashes of the
persistent tensors the sequence reads, the app thread it replays on), so that a restarted app
replays from its first inference. A document is the sequence's summary (the keys
``rrtoctl sequences`` shows: ``id``, ``app``, ``session``, ``thread``, ``operators`` (a loop's
body counted once), ``loops``, ``loop_variants`` (what a branched loop's iterations may go on
with: ``SeqLoop.variants``), ``inputs``,
``outputs``, ``found_at``, ``search_s``, ``log_length``, ``replays``, ``mismatches``,
``created``) plus ``fingerprint`` and ``definition`` (the ``SequenceDef``, base64 of its protobuf
bytes). The recorder saves, loads, forgets and counts through a ``SequenceStore``;
``rrtoctl sequences`` lists and ``rrtoctl flush`` drops the files, after which the next
inferences record again.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog
import xxhash

from rrto.v1 import ops_pb2

log = structlog.get_logger("rrtod.sequences")
Summary = dict[str, Any]


def fingerprint(d: ops_pb2.SequenceDef) -> str:
    """Identifies the model: the content hashes of the persistent tensors the sequence reads."""
    hashes = sorted({bytes(s.hash) for s in d.sources if s.kind == ops_pb2.SeqSource.PERSISTENT})
    return xxhash.xxh3_64_hexdigest(b"".join(hashes))


def _slug(app: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(app) or "app")[:64]


def _write(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` with ``doc`` at once. Sessions of one app save and count the same
    file from search threads and at their ends, concurrently (64 sessions of one app did): each
    writer has its own temporary file, so a reader sees a whole document, old or new."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any]:
    """One file's document; OSError or ValueError (also for JSON that is not an object)."""
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


class SequenceStore:
    """The sequence files under ``root``: every read and write of them goes through here."""

    def __init__(self, root: Path):
        self.root = root

    def _files(self, app: str | None = None) -> list[Path]:
        """Every sequence file, or those whose name carries ``app``'s slug (slugs of two apps
        can collide: callers that need one app also check the document's ``app``)."""
        pattern = "*.json" if app is None else f"{_slug(app)}-*.json"
        return sorted(self.root.glob(pattern)) if self.root.is_dir() else []

    def path(self, app: str, d: ops_pb2.SequenceDef) -> Path:
        return self.root / f"{_slug(app)}-{fingerprint(d)}-t{d.thread}.json"

    # ----- the recorder's side -----
    def save(self, app: str, summary: Summary, d: ops_pb2.SequenceDef) -> None:
        """Write (or replace) the file of ``d``; a failure costs the restart's head start, not
        the session, so it is logged, not raised."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            doc = {**summary, "fingerprint": fingerprint(d),
                   "definition": base64.b64encode(d.SerializeToString()).decode()}
            _write(self.path(app, d), doc)
        except OSError as exc:
            log.warning("cannot save sequence", error=str(exc), dir=str(self.root))

    def load(self, app: str) -> list[tuple[Summary, ops_pb2.SequenceDef]]:
        """``app``'s saved sequences, with their counters zeroed for the new session (a
        session's counts are added to the file when it ends: ``add_counts``)."""
        out = []
        for path in self._files(app):
            try:
                doc = _read(path)
                if doc.get("app") != app:
                    continue
                d = ops_pb2.SequenceDef()
                d.ParseFromString(base64.b64decode(doc["definition"]))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("unreadable saved sequence", path=str(path), error=str(exc))
                continue
            summary = {k: v for k, v in doc.items() if k not in ("definition", "fingerprint")}
            summary.update(replays=0, mismatches=0)
            out.append((summary, d))
        return out

    def forget(self, app: str, seq_id: int) -> None:
        """Delete ``app``'s saved copy of sequence ``seq_id`` (if any)."""
        for path, _doc in self._documents(app, {seq_id}):
            path.unlink(missing_ok=True)

    def add_counts(self, app: str, summaries: Iterable[Summary]) -> None:
        """Add a session's replay and mismatch counts to the saved files (at session end)."""
        by_id = {s["id"]: s for s in summaries}
        for path, doc in self._documents(app, set(by_id)):
            live = by_id[doc["id"]]
            doc.update(replays=doc.get("replays", 0) + live["replays"],
                       mismatches=doc.get("mismatches", 0) + live["mismatches"])
            try:
                _write(path, doc)
            except OSError as exc:  # counts are informational: the session ends regardless
                log.warning("cannot save sequence counts", error=str(exc), path=str(path))

    def _documents(self, app: str, ids: set[int]) -> list[tuple[Path, dict[str, Any]]]:
        """The readable files of ``app`` whose sequence id is one of ``ids``."""
        if not ids:
            return []
        found = []
        for path in self._files(app):
            try:
                doc = _read(path)
            except (OSError, ValueError):
                continue
            if isinstance(doc.get("id"), int) and doc["id"] in ids:
                found.append((path, doc))
        return found

    # ----- rrtoctl's side -----
    def list(self) -> list[Summary]:
        """Every saved sequence's summary (its document without the definition)."""
        out = []
        for path in self._files():
            try:
                doc = _read(path)
            except (OSError, ValueError) as exc:
                log.warning("unreadable sequence file", path=str(path), error=str(exc))
                continue
            summary = {k: v for k, v in doc.items() if k != "definition"}
            summary.setdefault("id", path.stem)
            out.append(summary)
        return out

    def flush(self, app: str | None = None) -> int:
        """Delete the sequences of ``app`` (all when None); returns how many were dropped."""
        dropped = 0
        for path in self._files():
            if app is not None:
                try:
                    if _read(path).get("app") != app:
                        continue
                except (OSError, ValueError):
                    continue
            path.unlink(missing_ok=True)
            dropped += 1
        return dropped
