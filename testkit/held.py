"""Held app processes for the forwarding suites (tests/test_torch_apps.py,
tests/test_session_limit.py): an unmodified app from tests/apps started under ``rrto-run``
that prints its outputs, then ``HOLD``, and keeps its session open until told to finish."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testkit import apps
from testkit.apps import APPS
from testkit.apps import app_env as clean_env
from testkit.daemons import BIN


def app_env(daemon: Any, **extra: str) -> dict[str, str]:
    """The environment of an app process. This suite checks forwarding: record/replay (which
    builds on it and has its own tests) is off, so every call here is forwarded."""
    return clean_env(**{**(daemon.env if daemon else {}), "RRTO_REPLAY": "0", **extra})


class App:
    """An app process started with ``--hold``: outputs, then the session stays open."""

    def __init__(self, name: str, env: dict[str, str], *flags: str, offload: bool = True,
                 mode: str = "stream"):
        cmd = [sys.executable, str(APPS / f"{name}.py"), *flags]
        if offload:
            cmd = [str(BIN / "rrto-run"), f"--{mode}", "--", *cmd]
        self.proc = subprocess.Popen(cmd, env=env, cwd=APPS, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def until_hold(self) -> str:
        out = []
        for line in self.proc.stdout:
            if line.strip() == "HOLD":
                return "".join(out)
            out.append(line)
        self.proc.wait(60)
        raise AssertionError(f"app exited {self.proc.returncode} before HOLD:\n"
                             f"{''.join(out)}\n{self.proc.stderr.read()}")

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate("\n", timeout=120)
        return self.proc.returncode, out, err


def start_local(name: str, *flags: str, dump: Path | None = None) -> Callable[[], str]:
    """The app started locally, in this suite's environment, beside what the test runs next
    (niced; a run with the same flags made earlier in the session is reused:
    ``testkit.apps.start_local``); call the result for what it prints."""
    return apps.start_local(name, *flags, dump=dump, extra_env={"RRTO_REPLAY": "0"},
                            timeout=120, background=True)


def run_local(name: str, *flags: str, dump: Path | None = None) -> str:
    """What the app prints locally, in this suite's environment (a run with the same flags
    made earlier in the session is reused: ``testkit.apps.start_local``)."""
    return apps.run_local(name, *flags, dump=dump, extra_env={"RRTO_REPLAY": "0"}, timeout=120)


def host_session(daemon: Any, pid: int) -> dict[str, Any]:
    status = daemon.status()
    for s in status["gpu"]["sessions"]:
        if s["pid"] == pid:
            return s
    raise AssertionError(f"no host session for pid {pid}: {status['gpu']['sessions']}")
