"""Correctness suite with real daemons: unmodified app scripts (tests/apps) run under rrto-run
against ``rrtod`` (robot+gpu) must print what the same script prints locally, and the daemon
must report the operators it executed for the session. Then bad input: refused operators,
malformed frames, quota, a host that disappears mid-inference."""

from __future__ import annotations

import json
import signal
import socket
import struct

import pytest
import torch

import rrtod
from rrtod.ctl import render_status
from testkit.apps import DAEMON_ENV, HOST, MODELS, assert_same_as_local, shim_stats
from testkit.daemons import TEST_DEFAULTS, Launcher, free_port
from testkit.held import App, app_env, host_session, start_local


@pytest.fixture(scope="module")
def daemon():
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        yield launcher.start("rrtod", **{**TEST_DEFAULTS, **HOST})


@pytest.mark.parametrize("name", MODELS)
def test_model_matches_local_and_daemon_counts_ops(daemon, name, tmp_path):
    want = start_local(name, dump=tmp_path / "local.json")
    app = App(name, app_env(daemon, RRTO_STATS="1"), "--hold", "--dump",
              str(tmp_path / "remote.json"))
    got = app.until_hold()
    session = host_session(daemon, app.proc.pid)
    rc, _, err = app.finish()
    assert rc == 0, err
    assert_same_as_local(name, got, want(), tmp_path / "remote.json", tmp_path / "local.json")
    # No warning (it was offloaded), just the shim's own figures; the host executed exactly
    # the operators the shim forwarded.
    (line,) = err.splitlines()
    shim = json.loads(line.removeprefix("rrto-stats "))
    assert session["ops"] == shim["calls"] > 0 and shim.get("local_ops", 0) == 0
    assert session["blob_puts"] + session["blob_hits"] > 0


@pytest.mark.parametrize("name", ["mlp_policy", "detection"])
def test_sync_mode_and_app_threads(daemon, name):
    want = start_local(name)
    app = App(name, app_env(daemon), "--thread", mode="sync")
    rc, out, err = app.finish()
    assert rc == 0, err
    assert out == want()


def test_restarted_app_uploads_no_weight_bytes(daemon):
    first = App("resnet", app_env(daemon), "--hold")
    first.until_hold()
    a = host_session(daemon, first.proc.pid)
    assert first.finish()[0] == 0
    second = App("resnet", app_env(daemon), "--hold")
    second.until_hold()
    b = host_session(daemon, second.proc.pid)
    assert second.finish()[0] == 0
    # The first run may find weights a parallel test already uploaded, so compare with the second.
    assert b["blob_puts"] == 0 and b["blob_hits"] == a["blob_puts"] + a["blob_hits"]


def test_other_library_operator_forwarded_or_local(daemon):
    want = start_local("custom_op")
    rc, out, err = App("custom_op", app_env(daemon)).finish()
    # the allowed library operator is forwarded silently; the other one says once that it runs
    # locally, and why
    assert rc == 0 and err.splitlines() == [
        "rrto: warning: rrtotest::shift.default runs locally (on this machine), not on the GPU "
        "host: the GPU host refuses it (rrto OP_NOT_ALLOWED: operator rrtotest::shift.default "
        "is not on this host's allowlist (no inference model needs it; executor.allow_extra "
        "adds it))"], err
    assert out == want()


def test_operator_with_another_schema_on_the_host_runs_locally(daemon):
    # rrtotest::blend has version 2's schema in the app, version 1's on the host: the host must
    # refuse it (running its own meaning would be a wrong result), naming both schemas and
    # versions; the app runs it here with one warning, or raises under fallback: error.
    want = start_local("skewed_op")
    rc, out, err = App("skewed_op", app_env(daemon)).finish()
    assert rc == 0 and out == want(), err
    (line,) = err.splitlines()
    torch_version = torch.__version__
    assert line.startswith(
        "rrto: warning: rrtotest::blend.default runs locally (on this machine), not on the GPU "
        "host: the GPU host refuses it (rrto SCHEMA_MISMATCH: operator rrtotest::blend.default "
        f"has a different schema in the app (torch {torch_version}, schema hash "), line
    assert line.endswith(
        f"than on this host (torch {torch_version}: rrtotest::blend(Tensor x, float w) -> "
        "Tensor)); here: rrtotest::blend(Tensor x, float w, float bias=0.) -> Tensor"), line
    rc, out, err = App("skewed_op", app_env(daemon, RRTO_FALLBACK="error")).finish()
    assert rc != 0 and "SCHEMA_MISMATCH" in err and "rrtotest::blend.default" in err, err


def test_status_names_each_sessions_versions_on_both_ends(daemon):
    app = App("mlp_policy", app_env(daemon), "--hold")
    app.until_hold()
    session = host_session(daemon, app.proc.pid)
    status = daemon.ctl("status")
    assert app.finish()[0] == 0
    mine = {"torch": torch.__version__, "rrtod": rrtod.__version__}  # the app runs this venv
    assert session["app_versions"] == mine and session["host_versions"] == mine
    (robot_side,) = [s for s in status["sessions"] if s["pid"] == app.proc.pid]
    assert robot_side["versions"] == mine and robot_side["host_versions"]["torch"] == mine["torch"]
    assert f"torch {torch.__version__}" in render_status(status)


def test_reviewed_library_operators_run_on_the_host(daemon):
    """A library in the host's reviewed table (libops.py) runs there without any allow_extra,
    including an operator whose output size depends on data; a listed library the host does not
    have is refused by the import probe and runs here with one warning."""
    local = start_local("library_ops")
    app = App("library_ops", app_env(daemon, RRTO_STATS="1"), "--hold")
    out = app.until_hold()
    host = host_session(daemon, app.proc.pid)
    rc, rest, err = app.finish()
    assert rc == 0, err
    want = local()
    assert out + rest == want  # same values and shapes (kept's size came from the host)
    stats = shim_stats(err)
    runs = want.count("\n") // 4  # appkit prints one line per output; four outputs a frame
    assert stats is not None and stats["local_ops"] == runs, stats  # only rrtoabsent::twice
    assert [line for line in err.splitlines() if line.startswith("rrto: warning")] == [
        "rrto: warning: rrtoabsent::twice.default runs locally (on this machine), not on the GPU "
        "host: the GPU host refuses it (rrto OP_NOT_ALLOWED: operator rrtoabsent::twice.default "
        "cannot run here: this host does not have the library rrtotest_absent_library "
        "(ModuleNotFoundError: No module named 'rrtotest_absent_library'))"], err
    assert host["ops"] >= 2 * runs  # keep_above and mul_add ran there, every frame


def test_refused_operator_raises_or_runs_locally(rrtod_daemon):
    d = rrtod_daemon(extra_env=DAEMON_ENV, executor={"deny": ["aten::tanh"]})
    want = start_local("mlp_policy")
    rc, out, err = App("mlp_policy", app_env(d, RRTO_FALLBACK="error")).finish()
    assert rc != 0 and "OP_NOT_ALLOWED" in err and "aten::tanh.default is denied" in err
    rc, out, err = App("mlp_policy", app_env(d)).finish()  # fallback: local (default)
    assert rc == 0 and out == want()
    assert [line for line in err.splitlines() if "runs locally" in line] == [
        "rrto: warning: aten::tanh.default runs locally (on this machine), not on the GPU host: "
        "the GPU host refuses it (rrto OP_NOT_ALLOWED: operator aten::tanh.default is denied "
        "on this host)"], err


def test_quota_exceeded_is_a_clear_error_and_session_freed(rrtod_daemon):
    d = rrtod_daemon(extra_env=DAEMON_ENV, executor={"memory_quota": 1024 * 1024})
    want = start_local("mlp_policy")
    rc, out, err = App("big_input", app_env(d)).finish()
    assert rc != 0 and "QUOTA_EXCEEDED" in err and "memory quota" in err
    status = d.wait_for(lambda s: not s["gpu"]["sessions"], what="session freed")
    assert status["gpu"]["sessions"] == []
    rc, out, err = App("mlp_policy", app_env(d)).finish()  # fits: the daemon still serves
    assert rc == 0 and out == want()


def test_malformed_frame_does_not_hurt_other_sessions(daemon):
    want = start_local("small_cnn")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(daemon.socket)
        s.sendall(struct.pack("<I", 7) + b"\xff\xff\xff\xff\xff\xff\xff")
        try:
            s.recv(4096)
        except (TimeoutError, ConnectionError):
            pass
    rc, out, err = App("small_cnn", app_env(daemon)).finish()
    assert rc == 0 and out == want(), err


@pytest.mark.parametrize("fallback", ["local", "error"])
def test_host_disappears_mid_inference(fallback):
    port = free_port()
    with Launcher(extra_env=DAEMON_ENV) as launcher:
        gpu = launcher.start("gpu", roles=["gpu"], listen=f"127.0.0.1:{port}", **TEST_DEFAULTS)
        robot = launcher.start("robot", roles=["robot"],
                               hosts=[{"name": "gpu", "address": f"127.0.0.1:{port}"}],
                               **TEST_DEFAULTS)
        want = start_local("mlp_policy")
        app = App("mlp_policy", app_env(robot, RRTO_FALLBACK=fallback), "--hold-mid")
        first = app.until_hold()
        gpu.proc.send_signal(signal.SIGKILL)
        gpu.proc.wait(10)
        rc, rest, err = app.finish()
        local = want()
        if fallback == "local":  # weights kept their local copies: later inferences run here
            assert rc == 0, err
            assert first + rest == local
        else:
            assert rc != 0 and "HOST_LOST" in err
        assert robot.proc.poll() is None  # the robot daemon keeps serving
