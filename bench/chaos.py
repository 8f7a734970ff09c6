"""``python -m bench.chaos``: GPU daemons killed or stalled under a running app, many times.

One robot daemon with two GPU daemons on this machine, and one unmodified test app
(tests/apps, a sensor-paced loop under ``rrto-run``, ``fallback: local``). Whenever the app
has replayed a few inferences on a host, that host is faulted:

- ``kill``: ``SIGKILL``, then started again on the same address (in the background: the app
  goes on meanwhile, on the other host or locally);
- ``stop``: ``SIGSTOP`` for ``--stall`` seconds, then ``SIGCONT`` (a host that hangs).

At the end the app's output is compared line by line with a local run of the same frames, and
its per-inference times (``appkit --times``) give the latency of the inferences each fault
hit. Reported: faults, errors the app saw (must be 0), frames that differ from local (must be
0), losses and reconnects the shim counted, p50/p99 latency, and per fault the extra latency of
the inference in flight (its time less the median), worst case included.

Writes bench/results/chaos-<fault>[-deadline<ms>].json and .md (``--out`` for another
directory).
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rrtod.ctl import request
from testkit.apps import APPS, DAEMON_ENV, app_env, shim_stats
from testkit.daemons import BIN, TEST_DEFAULTS, Launcher, free_port

RESULTS = Path(__file__).resolve().parent / "results"
# The robot daemon's health checks: a stalled host is down within 1.5 s (host_link.py).
HEALTH = {"interval": 0.5, "timeout": 0.5, "down_after": 2}
DAEMON = {**TEST_DEFAULTS, "health": HEALTH}


def _status(robot: Any) -> dict[str, Any]:
    return request(robot.socket, "status", timeout=10)


def _sessions(robot: Any) -> list[dict[str, Any]]:
    try:
        return _status(robot)["sessions"]
    except Exception:  # the daemon is busy: ask again
        return []


class HostFaults:
    """GPU daemons on fixed addresses, and the faults this benchmark (and ``bench.fleet``)
    inflicts on them: ``kill`` (``SIGKILL``, then host ``k`` started again by ``start(k)``, on
    its same address, in the background) and ``stop`` (``SIGSTOP`` for a while, then
    ``SIGCONT``). ``gpus[k]`` is host k's daemon, None while it is being started again; every
    fault is recorded in ``faults`` (``at``, ``host``, ``kind``, and ``back`` once it is up)."""

    def __init__(self, start: Callable[[int], Any], count: int):
        self.start = start
        self.gpus: list[Any] = [None] * count
        self.faults: list[dict[str, Any]] = []
        self._restarts: list[threading.Thread] = []

    def start_all(self) -> None:
        """Every host, started side by side."""
        errors: list[BaseException] = []

        def one(k: int) -> None:
            try:
                self.gpus[k] = self.start(k)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller
                errors.append(exc)
        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(self.gpus))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def up(self, k: int) -> bool:
        gpu = self.gpus[k]
        return gpu is not None and gpu.proc.poll() is None

    def kill(self, k: int, wait: bool = True) -> threading.Thread:
        """``wait``: return once host k is up again (never fault another host meanwhile, as in a
        fleet with spare capacity)."""
        gpu = self.gpus[k]
        fault: dict[str, Any] = {"at": time.monotonic(), "host": f"gpu{k}", "kind": "kill"}
        gpu.proc.send_signal(signal.SIGKILL)
        gpu.proc.wait(10)
        self.gpus[k] = None
        self.faults.append(fault)

        def restart() -> None:
            self.gpus[k] = self.start(k)
            fault["back"] = time.monotonic()
        t = threading.Thread(target=restart)
        t.start()
        self._restarts.append(t)
        if wait:
            t.join(120)
        return t

    def stop(self, k: int, seconds: float) -> None:
        gpu = self.gpus[k]
        fault: dict[str, Any] = {"at": time.monotonic(), "host": f"gpu{k}", "kind": "stop"}
        gpu.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            gpu.proc.send_signal(signal.SIGCONT)
        fault["back"] = time.monotonic()
        self.faults.append(fault)

    def join(self) -> None:
        """Until every restart has ended."""
        for t in self._restarts:
            t.join(120)


class Chaos:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.launcher = Launcher(extra_env=DAEMON_ENV)
        self.ports = [free_port(), free_port()]
        self.hosts = HostFaults(self._gpu, 2)

    @property
    def gpus(self) -> list[Any]:
        return self.hosts.gpus

    @property
    def faults(self) -> list[dict[str, Any]]:
        return self.hosts.faults

    def _gpu(self, k: int) -> Any:
        return self.launcher.start(f"gpu{k}", roles=["gpu"],
                                   listen=f"127.0.0.1:{self.ports[k]}", **DAEMON)

    def run(self) -> dict[str, Any]:
        a = self.args
        tmp = Path(tempfile.mkdtemp(prefix="rrto-chaos-"))
        times_path = tmp / "times.json"
        with self.launcher:
            self.hosts.start_all()
            robot = self.launcher.start(
                "robot", roles=["robot"], balancer="first-up",
                hosts=[{"name": f"gpu{k}", "address": f"127.0.0.1:{p}"}
                       for k, p in enumerate(self.ports)], **DAEMON)
            env = app_env(OMP_WAIT_POLICY="PASSIVE", RRTO_STATS="1", RRTO_FALLBACK="local")
            if a.deadline_ms:
                env["RRTO_DEADLINE_MS"] = str(a.deadline_ms)
            env.update(robot.env)
            app = subprocess.Popen(
                [str(BIN / "rrto-run"), "--", sys.executable, str(APPS / f"{a.app}.py"),
                 "--runs", "1", "--pace", str(a.pace), "--until-stdin", "--times",
                 str(times_path)], env=env, cwd=APPS, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                for n in range(a.faults):
                    host = self._replaying_host(robot, app)
                    if host is None:
                        break
                    self._fault(int(host.removeprefix("gpu")))
                    print(f"fault {n + 1}/{a.faults}: {a.fault} {host}", flush=True)
                self._until_offloading(robot, app)
                out, err = app.communicate("stop\n", timeout=600)
            finally:
                if app.poll() is None:
                    app.kill()
                self.hosts.join()
        return self._report(app.returncode, out, err, json.loads(times_path.read_text())
                            if times_path.exists() else [])

    def _replaying_host(self, robot: Any, app: subprocess.Popen[str]) -> str | None:
        """The host of the app's session once it has run ``--settle`` inferences there."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and app.poll() is None:
            for s in _sessions(robot):
                if s["inferences"] >= self.args.settle and s["host"] in ("gpu0", "gpu1"):
                    k = int(s["host"].removeprefix("gpu"))
                    if self.hosts.up(k):
                        return s["host"]
            time.sleep(0.05)
        return None

    def _until_offloading(self, robot: Any, app: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and app.poll() is None:
            if any(s["inferences"] >= self.args.settle for s in _sessions(robot)):
                return
            time.sleep(0.1)

    def _fault(self, k: int) -> None:
        if self.args.fault == "kill":
            # Never fault the other host while this one is still starting: the app must have
            # a host to go back to, as in a fleet with spare capacity.
            self.hosts.kill(k, wait=True)
        else:
            self.hosts.stop(k, self.args.stall)

    def _report(self, rc: int | None, out: str, err: str,
                times: list[tuple[float, float]]) -> dict[str, Any]:
        a = self.args
        stats = shim_stats(err) or {}
        runs = len(times)
        local = subprocess.run([sys.executable, str(APPS / f"{a.app}.py"), "--runs", str(runs)],
                               env=app_env(), cwd=APPS, capture_output=True, text=True,
                               timeout=600, check=True).stdout.splitlines()
        got = out.splitlines()
        differ = sum(1 for g, w in zip(got, local, strict=False) if g != w) + abs(
            len(got) - len(local))
        seconds = [d for _, d in times]
        t_first = times[0][0] if times else 0.0
        median = statistics.median(seconds) if seconds else 0.0
        hit = []
        for f in self.faults:  # the inference in flight at the fault, else the next one
            k = next((i for i, (t0, d) in enumerate(times) if t0 + d >= f["at"]), None)
            if k is not None:
                hit.append(round((seconds[k] - median) * 1e3, 2))
        errors = int(rc != 0) + err.count("Traceback") + err.count("HostLost")
        q = statistics.quantiles(seconds, n=100) if len(seconds) >= 2 else [0.0] * 99
        return {
            "fault": a.fault, "faults": len(self.faults), "app": a.app, "pace_ms": a.pace,
            "stall_s": a.stall if a.fault == "stop" else None,
            "inferences": runs, "app_exit": rc, "app_errors": errors,
            "frames_differing_from_local": differ,
            "hosts_lost": stats.get("hosts_lost", 0), "reconnects": stats.get("reconnects", 0),
            "recoveries": stats.get("recoveries", 0),
            "deadline_ms": a.deadline_ms, "deadline_misses": stats.get("deadline_misses", 0),
            "offline_s_mean": round(stats.get("offline_s", 0.0) / max(1, stats.get(
                "reconnects", 0)), 3),
            "p50_ms": round(median * 1e3, 2), "p99_ms": round(q[98] * 1e3, 2),
            "fault_extra_ms": hit,
            "slowest": sorted(((round(d * 1e3, 1), i, round(times[i][0] - t_first, 2))
                               for i, d in enumerate(seconds)), reverse=True)[:5],
            "timeline": [(round(f["at"] - t_first, 2), round(f.get("back", 0) - t_first, 2))
                         for f in self.faults],
            "faults_at_inference": [next((i for i, (t0, d) in enumerate(times)
                                          if t0 + d >= f["at"]), None) for f in self.faults],
            "worst_extra_ms": max(hit) if hit else None,
            "machine": f"{platform.node()} ({platform.processor() or platform.machine()})",
            "health": HEALTH,
        }


def render(r: dict[str, Any]) -> str:
    extra = r["fault_extra_ms"]
    return "\n".join([
        f"# Chaos: {r['faults']} × {r['fault']} of the app's GPU daemon (2 hosts)",
        "",
        f"App `{r['app']}`, paced {r['pace_ms']} ms, {r['inferences']} inferences; health "
        f"{r['health']}." + (f" Stalls of {r['stall_s']} s." if r["stall_s"] else ""),
        "",
        "| figure | value |", "|---|---|",
        f"| app errors | {r['app_errors']} (exit {r['app_exit']}) |",
        f"| frames differing from local | {r['frames_differing_from_local']} |",
        f"| losses / reconnects / rebuilt inferences (shim) | {r['hosts_lost']} / "
        f"{r['reconnects']} / {r['recoveries']} |",
        f"| offline per loss, mean | {r['offline_s_mean']} s |",
        f"| deadline ({r['deadline_ms']} ms) misses | {r['deadline_misses']} |",
        f"| latency p50 / p99 | {r['p50_ms']} / {r['p99_ms']} ms |",
        f"| extra latency of the faulted inference, median / worst | "
        f"{statistics.median(extra) if extra else '-'} / {r['worst_extra_ms']} ms |",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--fault", choices=["kill", "stop"], default="kill")
    p.add_argument("--faults", type=int, default=100)
    p.add_argument("--app", default="small_cnn")
    p.add_argument("--pace", type=float, default=20.0, help="ms between inferences")
    p.add_argument("--settle", type=int, default=5,
                   help="inferences on a host before it is faulted")
    p.add_argument("--stall", type=float, default=3.0, help="seconds a stopped host stays stopped")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="the app's intercept.deadline_ms (RRTO_DEADLINE_MS)")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    r = Chaos(a).run()
    a.out.mkdir(parents=True, exist_ok=True)
    name = f"chaos-{a.fault}" + (f"-deadline{a.deadline_ms:g}" if a.deadline_ms else "")
    (a.out / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
    (a.out / f"{name}.md").write_text(render(r))
    print(render(r))
    ok = r["app_errors"] == 0 and r["frames_differing_from_local"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
