"""Shared fixtures: real ``rrtod`` processes on temporary sockets, ports and state directories.

``rrtod_daemon(**overrides)`` starts a daemon (roles robot+gpu unless overridden) through
``testkit.daemons`` and waits for its systemd-style ``READY=1``. Daemons see
``testkit/echo_plugin`` on their path: the ``echo`` interception backend there lets the daemon
tests run without torch. Helpers that are not fixtures live in ``testkit``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.daemons import ECHO_PLUGIN, TEST_DEFAULTS, Launcher


@pytest.fixture
def rrtod_daemon() -> Iterator[Any]:
    path = os.pathsep.join(filter(None, [str(ECHO_PLUGIN), os.environ.get("PYTHONPATH")]))
    launcher = Launcher(extra_env={"PYTHONPATH": path})

    def start(name: str = "rrtod", extra_env: dict[str, str] | None = None, wait: bool = True,
              prefix: tuple[str, ...] = (), **overrides: Any) -> Any:
        return launcher.start(name, extra_env=extra_env, wait=wait, prefix=prefix,
                              **{**TEST_DEFAULTS, **overrides})

    yield start
    launcher.close()
