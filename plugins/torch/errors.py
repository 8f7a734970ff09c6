"""Exceptions the app sees when offloading fails. All are RuntimeErrors so that code written for
local torch failures (which raise RuntimeError) handles them too."""

from __future__ import annotations


class OffloadError(RuntimeError):
    """Base of every rrto error raised in the app; ``code`` is the host's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"rrto {code}: {message}")
        self.code = code


class RemoteOpError(OffloadError):
    """An operator forwarded to the GPU host failed there (or was refused)."""


class HostLost(OffloadError):
    """The GPU host or the local daemon went away; values that lived only there are gone."""

    def __init__(self, message: str):
        super().__init__("HOST_LOST", message)


class DeadlineMissed(Exception):
    """Internal: an inference's deadline passed while it waited for the host, and its values
    were rebuilt here (``intercept.deadline_ms``). Never reaches the app."""
