"""A host channel for a ``RemoteSession`` with no connection: the shim's tests drive the
session's replay client directly and read what it sent."""

from __future__ import annotations

from typing import Any


class Channel:
    """A host that takes every frame and answers nothing (the app never reads a value here)."""

    device, host, session = "cpu", "stub", 1

    def __init__(self) -> None:
        self.frames: list[Any] = []

    def start(self, on_down: Any, on_lost: Any) -> None:
        pass

    def send(self, frames: list[Any]) -> None:
        self.frames += frames

    def mark(self, *args: Any, **kwargs: Any) -> None:
        pass

    def flush_marks(self) -> None:
        pass

    def close(self) -> None:
        pass
