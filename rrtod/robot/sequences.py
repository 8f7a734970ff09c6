"""Saved inference operator sequences in the robot daemon's state directory.

One JSON document per sequence under ``<state_dir>/sequences/``, keyed by app and a fingerprint
of its persistent tensors, so that a restarted app replays from its first inference. The
recorder writes them (record/replay); ``rrtoctl sequences`` lists and ``rrtoctl flush`` drops
them, after which the next inferences record again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("rrtod.sequences")


class SequenceStore:
    def __init__(self, root: Path):
        self.root = root

    def _files(self) -> list[Path]:
        return sorted(self.root.glob("*.json")) if self.root.is_dir() else []

    def list(self) -> list[dict[str, Any]]:
        out = []
        for path in self._files():
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                log.warning("unreadable sequence file", path=str(path), error=str(exc))
                continue
            summary = {k: v for k, v in doc.items() if k not in ("ops", "definition")}
            summary.setdefault("id", path.stem)
            summary.setdefault("operators", len(doc.get("ops", [])))
            out.append(summary)
        return out

    def flush(self, app: str | None = None) -> int:
        """Delete the sequences of ``app`` (all when None); returns how many were dropped."""
        dropped = 0
        for path in self._files():
            if app is not None:
                try:
                    if json.loads(path.read_text()).get("app") != app:
                        continue
                except (OSError, ValueError):
                    continue
            path.unlink(missing_ok=True)
            dropped += 1
        return dropped
