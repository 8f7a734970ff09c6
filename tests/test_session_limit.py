"""The GPU daemon's session limit (``executor.max_sessions``): the config key, and real daemons
where one session over the limit is refused cleanly (``HOST_REFUSED`` before any welcome, the
app runs locally or fails with the reason), the sessions already open keep working, and a
freed slot is served again."""

from __future__ import annotations

import os
import signal
import urllib.request

import pytest
import yaml

from rrto.v1 import local_pb2
from rrtod.config import ConfigError, from_mapping
from rrtod.ctl import render_status
from testkit.apps import DAEMON_ENV
from testkit.daemons import TEST_DEFAULTS, Launcher, free_port
from testkit.peer import call, open_app


def test_config_key_default_and_errors() -> None:
    assert from_mapping({}).executor.max_sessions is None  # no limit unless configured
    assert from_mapping({"executor": {"max_sessions": 64}}).executor.max_sessions == 64
    for value, why in ((0, "greater than or equal to 1"), (-3, "greater than or equal to 1"),
                       ("many", "valid integer"), (True, "number of sessions"),
                       (2.5, "fractional part")):
        with pytest.raises(ConfigError) as err:
            from_mapping({"executor": {"max_sessions": value}}, "gpu.yaml")
        assert (err.value.file, err.value.key) == ("gpu.yaml", "executor.max_sessions")
        assert why in err.value.reason, (value, err.value.reason)


def _relays(conn, seq: int) -> bool:
    conn.send(call(seq, sync=True))
    return conn.recv(local_pb2.LocalReply).session.result.seq == seq


def test_session_over_the_limit_is_refused_and_a_freed_slot_is_served(rrtod_daemon):
    port, metrics = free_port(), free_port()
    gpu = rrtod_daemon("gpu", roles=["gpu"], listen=f"127.0.0.1:{port}",
                       metrics={"listen": f"127.0.0.1:{metrics}"},
                       executor={"backend": "echo", "max_sessions": 2})
    robot = rrtod_daemon("robot", roles=["robot"], intercept={"backend": "echo"},
                         hosts=[{"name": "edge", "address": f"127.0.0.1:{port}"}])
    robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="host up")
    first, w1 = open_app(robot.socket, app="one")
    second, w2 = open_app(robot.socket, app="two")
    assert w1.WhichOneof("msg") == w2.WhichOneof("msg") == "welcome"
    third, refused = open_app(robot.socket, app="three")
    assert refused.WhichOneof("msg") == "error", refused
    assert refused.error.code == "HOST_REFUSED"
    assert "RESOURCE_EXHAUSTED" in refused.error.message
    assert "2 sessions open, limit 2" in refused.error.message
    assert "executor.max_sessions" in refused.error.message
    third.close()
    # The two sessions keep working; both daemons keep serving.
    assert _relays(first, 1) and _relays(second, 1)
    status = gpu.ctl("status")["gpu"]
    assert status["max_sessions"] == 2 and len(status["sessions"]) == 2
    assert status["refused_sessions"] == {"executor.max_sessions": 1, "access.max_sessions": 0}
    assert "sessions 2 of max 2  refused 1" in render_status(gpu.ctl("status"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
    assert "rrto_host_session_limit 2.0" in body
    assert 'rrto_host_sessions_refused_total{limit="executor.max_sessions"} 1.0' in body
    robot_status = robot.wait_for(lambda s: len(s["sessions"]) == 2, what="refused one gone")
    assert robot_status["finished"]["sessions"] == 1
    assert any('"host refused session"' in line and "RESOURCE_EXHAUSTED" in line
               for line in robot.logs().splitlines())
    # A closed session frees its slot.
    first.close()
    gpu.wait_for(lambda s: len(s["gpu"]["sessions"]) == 1, what="slot freed")
    again, welcome = open_app(robot.socket, app="again")
    assert welcome.WhichOneof("msg") == "welcome", welcome
    assert _relays(again, 7) and _relays(second, 2)
    again.close()
    second.close()
    assert gpu.proc.poll() is None and robot.proc.poll() is None


def test_limit_counts_every_identity_and_reloads(rrtod_daemon):
    """One daemon with both roles (the unix peer link): the limit holds for it too, and a
    reload changes it for new sessions without closing any."""
    d = rrtod_daemon(executor={"backend": "echo", "max_sessions": 1},
                     intercept={"backend": "echo"})
    d.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="host up")
    one, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    two, refused = open_app(d.socket)
    assert refused.error.code == "HOST_REFUSED" and "1 session open, limit 1" in \
        refused.error.message
    two.close()
    assert "sessions 1 of max 1  refused 1" in render_status(d.ctl("status"))
    d.config_path.write_text(yaml.safe_dump({**d.config, "executor": {"backend": "echo",
                                                                      "max_sessions": 2}}))
    d.proc.send_signal(signal.SIGHUP)
    d.wait_notify("READY=1")
    assert d.ctl("status")["gpu"]["max_sessions"] == 2
    two, welcome = open_app(d.socket)
    assert welcome.WhichOneof("msg") == "welcome"
    assert _relays(one, 1) and _relays(two, 1)
    one.close()
    two.close()


def test_refused_torch_app_runs_locally_or_fails_with_the_reason():
    """Real apps: with a limit of 1 a second app is refused; under ``fallback: local`` it runs
    locally and prints what a local run prints, under ``error`` it fails naming the limit.
    The first app's session is untouched, and once it ends the next app is offloaded."""
    from testkit.held import App, app_env, host_session, run_local

    # Daemons and apps import the rrtod this test runs (a PYTHONPATH of the caller's stays).
    path = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    daemon_path = os.pathsep.join([DAEMON_ENV["PYTHONPATH"], *path.values()])
    with Launcher(extra_env={**DAEMON_ENV, "PYTHONPATH": daemon_path}) as launcher:
        d = launcher.start("rrtod", **{**TEST_DEFAULTS, "executor": {"max_sessions": 1}})
        want = run_local("mlp_policy")
        holder = App("mlp_policy", app_env(d, **path), "--hold")
        assert holder.until_hold() == want
        host_session(d, holder.proc.pid)  # offloaded
        rc, out, err = App("mlp_policy", app_env(d, RRTO_FALLBACK="local", **path)).finish()
        assert rc == 0 and out == want, err
        assert "running locally" in err and "HOST_REFUSED" in err
        assert "1 session open, limit 1" in err
        rc, out, err = App("mlp_policy", app_env(d, RRTO_FALLBACK="error", **path)).finish()
        assert rc != 0 and "HOST_REFUSED" in err and "1 session open, limit 1" in err, err
        assert d.ctl("status")["gpu"]["refused_sessions"]["executor.max_sessions"] == 2
        rc, out, err = holder.finish()
        assert rc == 0 and out == "", err
        d.wait_for(lambda s: not s["gpu"]["sessions"], what="slot freed")
        late = App("mlp_policy", app_env(d, **path), "--hold")
        assert late.until_hold() == want
        host_session(d, late.proc.pid)  # offloaded again
        assert late.finish()[0] == 0
        assert d.proc.poll() is None
