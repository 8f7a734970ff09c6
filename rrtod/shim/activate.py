"""Connect the app to the robot daemon and install the interception backend (after torch loads).

Settings: the socket is ``RRTO_SOCKET``, else the ``socket`` key of the daemon config
(``RRTO_CONFIG``, default /etc/rrto/rrtod.yaml); ``intercept.mode`` and ``intercept.fallback``
come from the same file and may be overridden by ``RRTO_MODE`` and ``RRTO_FALLBACK``;
``intercept.replay`` by ``RRTO_REPLAY=0|1``. Without a
reachable daemon or host the app runs locally after one warning line on stderr
(``fallback: local``), or fails at ``import torch`` with a message saying why (``fallback: error``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rrtod.switches import SwitchError, disabled_plugins, flag, milliseconds

DEFAULT_SOCKET = "/run/rrto/rrtod.sock"


@dataclass(frozen=True)
class ShimSettings:
    socket: str
    backend: str
    mode: str
    fallback: str
    replay: bool
    config_note: str = ""  # why the config file was not used, if it was not
    deadline_ms: float | None = None
    shared_uploads: bool = True  # ask the robot daemon for a shared upload region


def settings() -> ShimSettings:
    backend, mode, fallback, sock, note = "torch", "stream", "local", DEFAULT_SOCKET, ""
    replay = True
    deadline: float | None = None
    try:
        from rrtod.config import load

        cfg = load().config
        backend, mode, fallback, sock = (cfg.intercept.backend, cfg.intercept.mode,
                                         cfg.intercept.fallback, cfg.socket)
        replay = cfg.intercept.replay
        deadline = cfg.intercept.deadline_ms
    except Exception as exc:  # unreadable or absent config: defaults, and say so if it matters
        note = str(exc)
    try:
        replay = flag("RRTO_REPLAY", replay)
    except SwitchError as exc:
        note = f"{note}; {exc}: ignored" if note else f"{exc}: ignored"
    try:
        deadline = milliseconds("RRTO_DEADLINE_MS", deadline)
    except SwitchError as exc:
        note = f"{note}; {exc}: ignored" if note else f"{exc}: ignored"
    shared = True
    try:
        shared = flag("RRTO_SHARED_UPLOADS", shared)
    except SwitchError as exc:
        note = f"{note}; {exc}: ignored" if note else f"{exc}: ignored"
    mode = os.environ.get("RRTO_MODE", mode)
    fallback = os.environ.get("RRTO_FALLBACK", fallback)
    if mode not in ("stream", "sync"):
        mode = "stream"
    if fallback not in ("local", "error"):
        fallback = "local"
    return ShimSettings(os.environ.get("RRTO_SOCKET") or sock, backend, mode, fallback, replay,
                        note, deadline, shared)


def _warn(message: str) -> None:
    print(f"rrto: warning: {message}", file=sys.stderr, flush=True)


def _backend(name: str) -> Any:
    """The interception backend record called ``name``, loading as few plugins as possible."""
    from importlib.metadata import entry_points

    disabled = disabled_plugins()  # blocked here as in the daemon's registry
    if name in disabled:
        raise LookupError(f"interception backend {name!r} is disabled by RRTO_DISABLE_PLUGINS")
    eps = sorted(entry_points(group="rrto"), key=lambda ep: ep.name != name)
    for ep in eps:
        if ep.name in disabled:
            continue
        try:
            hook = getattr(ep.load(), "rrto_interception_backends", None)
            records = hook() if hook else []
        except Exception:  # a broken third-party plugin is skipped, as in the daemon
            continue
        for record in records:
            if record.name == name:
                return record
    raise LookupError(f"no interception backend named {name!r} is installed")


def app_versions(record: Any) -> dict[str, str]:
    """What the app runs, for its hello: this rrtod and the backend's framework."""
    from rrtod import __version__

    versions = {"rrtod": __version__}
    if getattr(record, "versions", None) is not None:
        versions.update(record.versions())
    return versions


_state: dict[str, Any] = {}


def interceptor() -> Any:
    """The active interceptor, or None when the app runs locally."""
    return _state.get("interceptor")


def activate() -> Any:
    if "done" in _state:
        return _state.get("interceptor")
    _state["done"] = True
    s = settings()
    try:
        record = _backend(s.backend)
        from rrtod.shim.channel import SocketChannel

        app = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
        channel = SocketChannel(s.socket, app=app, pid=os.getpid(), argv=list(sys.argv),
                                executor=s.backend, versions=app_versions(record),
                                shared_uploads=s.shared_uploads)
    except (OSError, LookupError) as exc:
        reason = f"{exc}" if not isinstance(exc, FileNotFoundError) else \
            f"no rrtod socket at {s.socket}"
        if s.fallback == "error":
            raise RuntimeError(f"rrto: cannot offload ({reason}) and intercept.fallback is "
                               "'error'") from None
        _warn(f"offloading disabled, running locally: {reason}")
        return None
    _state["interceptor"] = record.factory(channel, mode=s.mode, fallback=s.fallback,
                                           replay=s.replay, deadline_ms=s.deadline_ms)
    return _state["interceptor"]
