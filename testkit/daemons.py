"""Run rrtod daemons as child processes: for the demo, the benchmark and the tests.

A child is ready when it sends systemd's ``READY=1`` to a datagram socket we own, exactly as
under systemd, so nothing polls or sleeps on a guess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
# For a daemon's PYTHONPATH: the ``echo`` interception backend (a plugin that needs no torch).
ECHO_PLUGIN = Path(__file__).resolve().parent / "echo_plugin"
# Config of a daemon whose apps and sessions use that ``echo`` backend.
ECHO = {"intercept": {"backend": "echo"}, "executor": {"backend": "echo"}}

# The test suite's daemons: fast health checks, debug logs, a short drain, waits for searches.
# A host is down after two pings unanswered for 2 s each: a killed one fails at once
# (connection refused), and a loaded CI machine answering slowly does not end sessions (a down
# host fails its sessions).
TEST_DEFAULTS: dict[str, Any] = {
    "health": {"interval": 0.2, "timeout": 2.0, "down_after": 2},
    "log": {"format": "json", "level": "debug"},
    "drain_timeout": 3,
    # An app's inference start waits for the search of the inferences before it until it ends
    # (tests check that replay starts with the third inference back to back; the default
    # 0.1 s is short on a loaded CI machine: search, then the host's acceptance).
    "record": {"search_wait": 5.0, "hint_budget": 10.0},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_config(base: Path, name: str) -> dict[str, Any]:
    """A self-contained daemon config inside ``base``: no metrics port, and a peer link on
    loopback TCP, plaintext, written out explicitly (``tls.mode: insecure``), because the
    benchmark's emulated links are TCP proxies and tests run robot and GPU daemons apart.
    ``listen=None`` gives the shipped default instead: the unix peer socket only."""
    return {
        "node": name,
        "socket": str(base / "rrtod.sock"),
        "state_dir": str(base / "state"),
        "listen": f"127.0.0.1:{free_port()}",
        "tls": {"mode": "insecure"},
        "metrics": {"listen": None},
        "log": {"format": "json", "level": "info"},
    }


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    base: Path
    config_path: Path
    config: dict[str, Any]
    log_path: Path
    notify: socket.socket
    notifications: list[str] = field(default_factory=list)

    @property
    def socket(self) -> str:
        return self.config["socket"]

    @property
    def listen(self) -> str:
        """The GPU daemon's peer address: its TCP ``listen``, else its unix peer socket."""
        if self.config.get("listen"):
            return self.config["listen"]
        return f"unix:{Path(self.socket).parent / 'peer.sock'}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for app processes that should use this daemon."""
        return {"RRTO_CONFIG": str(self.config_path), "RRTO_SOCKET": self.socket}

    def ctl(self, *args: str, check: bool = True) -> Any:
        out = subprocess.run([str(BIN / "rrtoctl"), "--config", str(self.config_path), *args,
                              "--json"], capture_output=True, text=True, timeout=30)
        if check and out.returncode != 0:
            raise RuntimeError(f"rrtoctl {' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return json.loads(out.stdout) if out.returncode == 0 else out

    def wait_notify(self, text: str, timeout: float = 60.0) -> str:
        """Block until a notify datagram containing ``text`` arrives; returns it."""
        for seen in self.notifications:
            if text in seen:
                self.notifications.remove(seen)
                return seen
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rrtod exited {self.proc.returncode}:\n{self.logs()}")
            self.notify.settimeout(min(0.5, max(0.01, deadline - time.monotonic())))
            try:
                msg = self.notify.recv(4096).decode()
            except TimeoutError:
                continue
            if text in msg:
                return msg
            self.notifications.append(msg)
        raise RuntimeError(f"no {text!r} from rrtod within {timeout}s:\n{self.logs()}")

    def ask(self, command: str, **args: str) -> Any:
        """``ctl``'s result for ``command`` (e.g. ``ask("flush", all="1")`` for ``ctl("flush",
        "--all")``), asked over the daemon's socket from this process (``rrtod.ctl.request``,
        what rrtoctl sends): for polls and fixtures, where a ``rrtoctl`` process per call
        costs half a second of CPU that the daemons and apps under test need. ``ctl`` is for
        tests of rrtoctl itself (tests/test_daemon.py and others keep using it)."""
        from rrtod.ctl import request  # here: testkit.apps (stdlib only) imports this module

        return request(self.socket, command, args, timeout=30)

    def status(self) -> Any:
        return self.ask("status")

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 15.0,
                 what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            status = self.status()
            if predicate(status):
                return status
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {what}; last status: {status}")

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class Launcher:
    """Starts daemons in private temporary directories and cleans them all up."""

    def __init__(self, extra_env: dict[str, str] | None = None):
        self.extra_env = extra_env or {}
        self.daemons: list[Daemon] = []
        self._dirs: list[Path] = []

    def start(self, name: str = "rrtod", extra_env: dict[str, str] | None = None,
              wait: bool = True, prefix: Sequence[str] = (), **overrides: Any) -> Daemon:
        """``prefix``: a command that runs the daemon (and must exec it, so that signals reach
        it), e.g. ``unshare`` to give it a private /etc/hosts."""
        import yaml  # here, not at the top: testkit.apps (stdlib only) imports this module

        # Unix socket paths are limited to 108 bytes: keep them short, under /tmp.
        base = Path(tempfile.mkdtemp(prefix="rrto-", dir="/tmp"))
        self._dirs.append(base)
        config = base_config(base, name)
        config.update(overrides)
        path = base / "rrtod.yaml"
        path.write_text(yaml.safe_dump(config))
        notify_path = str(base / "notify")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        env = {**os.environ, "NOTIFY_SOCKET": notify_path, "PYTHONUNBUFFERED": "1",
               **self.extra_env, **(extra_env or {})}
        env.pop("WATCHDOG_PID", None)
        log_path = base / "rrtod.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "rrtod", "--config", str(path)],
                                    env=env, stdout=log_file, stderr=subprocess.STDOUT)
        daemon = Daemon(proc, base, path, config, log_path, notify)
        self.daemons.append(daemon)
        if wait:
            daemon.wait_notify("READY=1")
        return daemon

    def wait_ready(self, daemons: Sequence[Daemon]) -> None:
        """Wait for ``READY=1`` from each of ``daemons`` (started with ``wait=False``, so that
        their start-ups, mostly imports, overlap)."""
        for daemon in daemons:
            daemon.wait_notify("READY=1")

    def close(self) -> None:
        # All signalled first, then waited for: each drains and exits on its own, at once.
        for daemon in self.daemons:
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.proc.wait(20.0)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()
                daemon.proc.wait()
            daemon.notify.close()
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
