"""The systemd integration: unit file, sysusers/tmpfiles snippets, and the sd_notify protocol.

``systemd-analyze verify`` exits 0 even for unknown keys and bad values, so every verify test
fails on any output at all. The machines that run tests have systemd's tools but no running
systemd, hence a private unit directory (``SYSTEMD_UNIT_PATH``) and ``--root`` trees; the notify
protocol is checked against a datagram socket the test owns, exactly where systemd would listen.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rrtod.config import Config
from rrtod.sdnotify import Notifier

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "rrtod.service"
SYSUSERS = ROOT / "systemd" / "rrto.sysusers.conf"
TMPFILES = ROOT / "systemd" / "rrto.tmpfiles.conf"
DROP_INS = sorted((ROOT / "systemd" / "examples").glob("*.conf"))

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")


def _unit_directives(path: Path) -> dict[str, list[str]]:
    """``Key -> [values]`` over all sections, in file order (systemd keys may repeat)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _with_existing_commands(text: str) -> str:
    """Point ExecStart at an executable that exists here, keeping its arguments: verify checks
    that the command is executable, and rrtod is not installed under /usr/bin or /opt on a
    development machine. Everything else in the unit stays byte-identical."""
    true = shutil.which("true") or "/bin/true"
    return re.sub(r"^(ExecStart=)\S*rrtod\b", rf"\g<1>{true}", text, flags=re.M)


def _verify(unit_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_PAGER": "", "LC_ALL": "C"}
    return subprocess.run(
        [ANALYZE, "verify", "--man=no", str(unit_dir / "rrtod.service")],
        capture_output=True, text=True, env=env, timeout=60,
    )


# --- unit file --------------------------------------------------------------------------------


@needs_analyze
def test_unit_verifies_without_any_output(tmp_path: Path) -> None:
    (tmp_path / "rrtod.service").write_text(_with_existing_commands(UNIT.read_text()))
    result = _verify(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == "", result.stderr + result.stdout


@needs_analyze
def test_verify_is_strict_enough_to_catch_a_typo(tmp_path: Path) -> None:
    """Guards the test above: verify must actually read our file and complain about a bad key."""
    text = _with_existing_commands(UNIT.read_text()).replace("NoNewPrivileges=", "NoNewPrivilege=")
    (tmp_path / "rrtod.service").write_text(text)
    result = _verify(tmp_path)
    assert "Unknown key" in result.stderr and "NoNewPrivilege" in result.stderr


@needs_analyze
def test_real_unit_only_complains_about_the_missing_binary(tmp_path: Path) -> None:
    """Without the rewrite, the only finding is that /usr/bin/rrtod is not installed here."""
    (tmp_path / "rrtod.service").write_text(UNIT.read_text())
    result = _verify(tmp_path)
    if Path("/usr/bin/rrtod").exists():
        assert result.stderr == ""
    else:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines and all("/usr/bin/rrtod" in line for line in lines), result.stderr


@needs_analyze
@pytest.mark.parametrize("drop_in", DROP_INS, ids=lambda p: p.name)
def test_example_drop_ins_verify(tmp_path: Path, drop_in: Path) -> None:
    (tmp_path / "rrtod.service").write_text(_with_existing_commands(UNIT.read_text()))
    (tmp_path / "rrtod.service.d").mkdir()
    (tmp_path / "rrtod.service.d" / drop_in.name).write_text(
        _with_existing_commands(drop_in.read_text())
    )
    result = _verify(tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_drop_ins_exist_for_venv_and_jetson() -> None:
    assert {p.name for p in DROP_INS} >= {"venv.conf", "jetson.conf"}
    venv = _unit_directives(ROOT / "systemd" / "examples" / "venv.conf")
    assert venv["ExecStart"][0] == "", "a drop-in must clear ExecStart before replacing it"


def test_unit_contract() -> None:
    """The settings the daemon and the docs rely on."""
    d = _unit_directives(UNIT)
    one = {k: v[-1] for k, v in d.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["ExecStart"] == "/usr/bin/rrtod --config /etc/rrto/rrtod.yaml"
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert one["WatchdogSec"] == "30" and one["Restart"] == "on-failure"
    assert one["User"] == "rrto" and one["Group"] == "rrto"
    assert one["RuntimeDirectory"] == "rrto" and one["StateDirectory"] == "rrto"
    assert one["KillSignal"] == "SIGTERM"
    # Group rrto must be able to traverse /run/rrto to reach the 0660 socket.
    assert int(one["RuntimeDirectoryMode"], 8) & 0o050 == 0o050
    assert Config().socket_mode == 0o660
    # Stop must outlast the daemon's own drain, or systemd kills sessions mid-drain.
    stop = float(one["TimeoutStopSec"].removesuffix("s"))
    assert stop > Config().drain_timeout
    # The state directory is where the daemon writes, by default.
    assert Config().state_dir == "/var/lib/rrto" and Config().socket.startswith("/run/rrto/")


def test_unit_hardening_is_cuda_compatible() -> None:
    d = _unit_directives(UNIT)
    one = {k: v[-1] for k, v in d.items()}
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                "RestrictNamespaces", "LockPersonality", "RestrictRealtime"):
        assert one[key] == "yes", key
    assert one["ProtectSystem"] == "strict"
    assert one["CapabilityBoundingSet"] == ""
    assert one["SystemCallArchitectures"] == "native"
    assert set(one["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6",
                                                           "AF_NETLINK"}
    # CUDA JIT needs W+X pages; PrivateDevices hides /dev/nvidia*.
    assert "MemoryDenyWriteExecute" not in d
    assert "PrivateDevices" not in d
    # With a closed device policy the GPU nodes must be allowed explicitly.
    assert one["DevicePolicy"] == "closed"
    assert any(v.startswith("char-nvidia") for v in d["DeviceAllow"])


@needs_analyze
def test_security_score(tmp_path: Path) -> None:
    """Record the exposure score (lower is better); a change that loosens the unit a lot must
    be a decision, not an accident."""
    result = subprocess.run(
        [ANALYZE, "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "LC_ALL": "C"},
    )
    match = re.search(r"Overall exposure level for rrtod\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 2.5


# --- sysusers / tmpfiles ----------------------------------------------------------------------


def _root_with(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    for sub, src in (("usr/lib/sysusers.d", SYSUSERS), ("usr/lib/tmpfiles.d", TMPFILES)):
        (root / sub).mkdir(parents=True)
        shutil.copy(src, root / sub / "rrto.conf")
    (root / "etc").mkdir()
    return root


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers missing")
def test_sysusers_creates_the_rrto_user(tmp_path: Path) -> None:
    root = _root_with(tmp_path)
    result = subprocess.run(["systemd-sysusers", f"--root={root}"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    noise = [line for line in result.stderr.splitlines() if not line.startswith("Creating ")]
    assert noise == [], result.stderr
    passwd = {line.split(":")[0]: line.split(":") for line in
              (root / "etc/passwd").read_text().splitlines()}
    group = {line.split(":")[0]: line.split(":") for line in
             (root / "etc/group").read_text().splitlines()}
    assert "rrto" in passwd and "rrto" in group
    user = passwd["rrto"]
    assert user[3] == group["rrto"][2], "primary group of rrto is rrto"
    assert int(user[2]) < 1000, "a system user"
    assert user[5] == "/var/lib/rrto" and user[6].endswith("nologin")


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None
    or os.geteuid() != 0,
    reason="needs systemd-sysusers, systemd-tmpfiles and root (chown)",
)
def test_tmpfiles_creates_the_layout(tmp_path: Path) -> None:
    root = _root_with(tmp_path)
    subprocess.run(["systemd-sysusers", f"--root={root}"], check=True, capture_output=True)
    result = subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    uid = gid = None
    for line in (root / "etc/passwd").read_text().splitlines():
        if line.startswith("rrto:"):
            uid, gid = int(line.split(":")[2]), int(line.split(":")[3])
    expect = {
        "etc/rrto": (0, gid, 0o750), "etc/rrto/rrtod.d": (0, gid, 0o750),
        "etc/rrto/tls": (0, gid, 0o750), "var/lib/rrto": (uid, gid, 0o750),
        "var/cache/rrto": (uid, gid, 0o750),
    }
    for rel, (owner, grp, mode) in expect.items():
        st = (root / rel).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (owner, grp, mode), rel


def test_tmpfiles_and_unit_agree_on_the_state_directory() -> None:
    lines = [line.split() for line in TMPFILES.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    by_path = {fields[1]: fields for fields in lines}
    assert all(fields[0] == "d" and len(fields) == 7 for fields in lines)
    unit = {k: v[-1] for k, v in _unit_directives(UNIT).items()}
    assert by_path["/var/lib/rrto"][2] == unit["StateDirectoryMode"]
    assert by_path["/var/lib/rrto"][3:5] == [unit["User"], unit["Group"]]


def test_unit_file_parses_as_ini() -> None:
    """Catches stray section headers or continuation mistakes that verify would accept."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    assert parser.sections() == ["Unit", "Service", "Install"]
    assert parser["Install"]["WantedBy"] == "multi-user.target"


# --- sd_notify protocol -----------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket where systemd would listen, at a filesystem path."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


def _fields(datagram: bytes) -> dict[str, str]:
    lines = datagram.decode().split("\n")
    assert all("=" in line for line in lines), lines
    return dict(line.split("=", 1) for line in lines)


def test_ready_status_watchdog_stopping(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    n = Notifier(path)
    assert n.enabled
    n.ready("serving on /run/rrto/rrtod.sock")
    assert _fields(sock.recv(4096)) == {"READY": "1", "STATUS": "serving on /run/rrto/rrtod.sock"}
    n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    n.status("2 sessions")
    assert sock.recv(4096) == b"STATUS=2 sessions"
    n.stopping()
    fields = _fields(sock.recv(4096))
    assert fields["STOPPING"] == "1" and "STATUS" in fields


def test_reloading_carries_monotonic_usec(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    Notifier(path).reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    fields = _fields(sock.recv(4096))
    assert fields["RELOADING"] == "1"
    # systemd matches the reload to this timestamp: it must be CLOCK_MONOTONIC in microseconds.
    assert before <= int(fields["MONOTONIC_USEC"]) <= after


def test_newlines_cannot_forge_assignments(notify_socket: tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    Notifier(path).status("reload failed:\nREADY=1")
    fields = _fields(sock.recv(4096))
    assert list(fields) == ["STATUS"] and "READY=1" in fields["STATUS"]


def test_abstract_namespace_address() -> None:
    name = f"rrto-test-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        Notifier("@" + name).ready("ok")
        assert _fields(sock.recv(4096)) == {"READY": "1", "STATUS": "ok"}
    finally:
        sock.close()


def test_environment_is_the_default_address(
    notify_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    Notifier().watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_no_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    n.ready("x")
    n.watchdog()
    n.reloading()
    n.stopping()  # nothing to assert beyond "does not raise": there is nowhere to send


def test_vanished_listener_does_not_raise(tmp_path: Path) -> None:
    n = Notifier(str(tmp_path / "gone"))
    assert n.enabled
    n.ready("x")  # systemd restarting or socket removed: a status line must never be fatal


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", "self", 15.0),
        ("30000000", None, 15.0),
        ("30000000", "1", None),  # meant for another process
        (None, None, None),
        ("0", None, None),
        ("soon", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, str(os.getpid()) if value == "self" else value)
    assert Notifier("").watchdog_interval() == expected


def test_watchdog_interval_matches_the_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """What systemd exports for WatchdogSec=30 makes the daemon ping every 15 s."""
    sec = int({k: v[-1] for k, v in _unit_directives(UNIT).items()}["WatchdogSec"])
    monkeypatch.setenv("WATCHDOG_USEC", str(sec * 1_000_000))
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier("").watchdog_interval() == sec / 2
