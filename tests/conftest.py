"""Shared fixtures: real ``rrtod`` processes on temporary sockets, ports and state directories.

``rrtod_daemon(**overrides)`` starts a daemon (roles robot+gpu unless overridden) and waits for
its systemd-style ``READY=1`` on a datagram socket the fixture owns, so tests never sleep-poll.
Daemons see ``tests/testkit`` on their path: the ``echo`` interception backend there lets the
daemon tests run without torch.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TESTKIT = REPO / "tests" / "testkit"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DaemonHandle:
    proc: subprocess.Popen[bytes]
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
        return self.config["listen"]

    @property
    def env(self) -> dict[str, str]:
        """Environment for app subprocesses that should use this daemon."""
        return {"RRTO_CONFIG": str(self.config_path), "RRTO_SOCKET": self.socket}

    def ctl(self, *args: str, check: bool = True) -> Any:
        out = subprocess.run([str(BIN / "rrtoctl"), "--config", str(self.config_path), *args,
                              "--json"], capture_output=True, text=True, timeout=30)
        if check and out.returncode != 0:
            raise AssertionError(f"rrtoctl {' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return json.loads(out.stdout) if out.returncode == 0 else out

    def wait_notify(self, text: str, timeout: float = 30.0) -> str:
        """Block until a notify datagram containing ``text`` arrives; returns it."""
        deadline = time.monotonic() + timeout
        for seen in self.notifications:
            if text in seen:
                self.notifications.remove(seen)
                return seen
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"rrtod exited {self.proc.returncode}:\n{self.logs()}")
            self.notify.settimeout(min(0.5, max(0.01, deadline - time.monotonic())))
            try:
                msg = self.notify.recv(4096).decode()
            except TimeoutError:
                continue
            if text in msg:
                return msg
            self.notifications.append(msg)
        raise AssertionError(f"no {text!r} from rrtod within {timeout}s:\n{self.logs()}")

    def wait_for(self, predicate: Any, timeout: float = 15.0, what: str = "condition") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.ctl("status")
            if predicate(status):
                return status
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last status: {status}")

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


@pytest.fixture
def rrtod_daemon() -> Iterator[Any]:
    handles: list[DaemonHandle] = []
    dirs: list[str] = []

    def start(name: str = "rrtod", extra_env: dict[str, str] | None = None, wait: bool = True,
              **overrides: Any) -> DaemonHandle:
        # Unix socket paths are limited to 108 bytes: keep them short, outside tmp_path.
        base = Path(tempfile.mkdtemp(prefix="rrto-", dir="/tmp"))
        dirs.append(str(base))
        config: dict[str, Any] = {
            "node": name,
            "socket": str(base / "rrtod.sock"),
            "state_dir": str(base / "state"),
            "listen": f"127.0.0.1:{free_port()}",
            "tls": {"mode": "insecure"},
            "metrics": {"listen": None},
            "health": {"interval": 0.2, "timeout": 0.5, "down_after": 2},
            "log": {"format": "json", "level": "debug"},
            "drain_timeout": 3,
        }
        config.update(overrides)
        path = base / "rrtod.yaml"
        path.write_text(yaml.safe_dump(config))
        notify_path = str(base / "notify")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        env = {**os.environ, "NOTIFY_SOCKET": notify_path, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTKIT),
                                                          os.environ.get("PYTHONPATH")])),
               **(extra_env or {})}
        log_path = base / "rrtod.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen([str(BIN / "rrtod"), "--config", str(path)], env=env,
                                    stdout=log_file, stderr=subprocess.STDOUT)
        handle = DaemonHandle(proc, path, config, log_path, notify)
        handles.append(handle)
        if wait:
            handle.wait_notify("READY=1")
        return handle

    yield start
    for h in handles:
        h.stop()
        h.notify.close()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
