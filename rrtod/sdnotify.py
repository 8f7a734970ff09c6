"""systemd's notify protocol (sd_notify), a few lines instead of a dependency.

With ``Type=notify`` the unit waits for ``READY=1``; ``WATCHDOG=1`` must arrive within
``WatchdogSec``; a reload is bracketed by ``RELOADING=1`` (with ``MONOTONIC_USEC``) and
``READY=1``; ``STOPPING=1`` announces shutdown. Outside systemd (no ``NOTIFY_SOCKET``) every call
is a no-op, so the daemon runs the same in a terminal.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, address: str | None = None):
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: object) -> None:
        if self._sock is None or self.address is None:
            return
        # One assignment per line: a newline inside a value (an exception text in STATUS=)
        # would otherwise be read by systemd as a second, forged assignment.
        text = "\n".join(
            f"{key.upper()}={' '.join(str(value).splitlines())}" for key, value in fields.items()
        )
        # An address starting with "@" is in the abstract namespace.
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto(text.encode(), target)
        except OSError:
            pass  # systemd gone or socket full: never take the daemon down for a status line

    def ready(self, status: str) -> None:
        self.notify(ready=1, status=status)

    def status(self, status: str) -> None:
        self.notify(status=status)

    def reloading(self) -> None:
        self.notify(reloading=1, monotonic_usec=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self) -> None:
        self.notify(stopping=1, status="draining sessions")

    def watchdog(self) -> None:
        self.notify(watchdog=1)

    def watchdog_interval(self) -> float | None:
        """Half of systemd's WatchdogSec for this process, in seconds, or None if not asked.

        ``WATCHDOG_PID`` names the process the watchdog is meant for (a child inheriting the
        environment must not ping); a malformed or zero ``WATCHDOG_USEC`` means no watchdog
        rather than a crash at start."""
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        if pid and pid != str(os.getpid()):
            return None
        try:
            value = int(usec)
        except ValueError:
            return None
        return value / 2e6 if value > 0 else None
