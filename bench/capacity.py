"""Capacity: N concurrent app sessions, each replaying, on one GPU daemon.

    python -m bench.capacity [--sessions 64] [--app mlp_policy] [--pace-ms 500] [--window-s 30]
                             [--robots 1] [--limit N | --no-limit] [--threads 1] [--out DIR]

Starts one GPU daemon (``roles: [gpu]``, ``executor.max_sessions`` = ``--limit``, by default N)
and ``--robots`` robot daemons (``roles: [robot]``, apps spread over them in turn) on loopback
TCP, then N app processes: the unmodified test app (``tests/apps/APP.py``) under ``rrto-run``
with ``RRTO_STATS=1``, replay on, ``RRTO_FALLBACK=error`` (an app that cannot offload fails,
it never runs locally unseen), in a paced loop (``--pace-ms`` after each inference, as a
sensor-paced robot loop) until told to stop. Each app process has one session.

How it measures. The app runs inside a small driver (``--child``, this module, as in
bench/replay.py) that changes nothing in it: it times each inference from the moment its input
exists to the moment every output has been read (``appkit.describe``), and stamps its end with
CLOCK_MONOTONIC (one clock for every process here), with whether the shim replayed it (its
``replays`` counter went up by one, no mismatch). Apps start in batches of ``--batch``, the
next batch once each app of this one has replayed (N torch imports and recording phases at
once would starve everything on a small machine). Once every app has replayed an inference,
the steady window starts and lasts ``--window-s``; latency percentiles, the replay share and
inferences per second are over every inference of every session that ended inside it.
During the window the GPU daemon's RSS (and USS), threads and CPU, the robot daemons' CPU, the
apps' RSS and the CPU that the rest of the machine used are sampled every second; the GPU
daemon's RSS at idle (started, host up, no session) is taken before any app starts, and after
every session ended. Bytes per session = (RSS at N sessions - idle RSS) / N.

Then, with a limit configured, one app more (N+1) is started twice, under
``RRTO_FALLBACK=error`` and ``local``: the GPU daemon must refuse it (``HOST_REFUSED`` naming
the limit; it fails, or runs locally and prints what the N apps print), and the N sessions
must go on replaying after it. With ``--no-limit`` the extra app must be served instead.
Writes ``capacity.json`` and ``capacity.md`` to ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from testkit.apps import APPS, STATS_PREFIX, app_env, shim_stats  # stdlib only at import

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = REPO / "bench" / "results"
MARK = "@rrto-capacity "  # driver -> this process, on the app's stdout
# Every process of the run (see bench/harness.py): no OpenMP spinning between inferences.
PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
APP_ENV = {"RRTO_MODE": "stream", "RRTO_REPLAY": "1", "RRTO_STATS": "1"}
SAMPLE_S = 1.0
SETTLE_S = 2.0  # after the last app replays, before the window opens
AFTER_S = 10.0  # after the extra app: do the N sessions still replay?
# The robot daemons' health checks of the GPU host. The default (1 s timeout, down after 2
# lost pings) marked the host down while 64 apps imported torch on this 2-core machine, and an
# app that arrived then got NO_HOST: here every process shares the cores, which a robot and
# its GPU host would not. The run is about capacity, not failure detection.
HEALTH = {"interval": 1.0, "timeout": 10.0, "down_after": 5}


# ---------------------------------------------------------------------------------------------
# The driver inside the app process (stdlib at import: the shim activates with torch).
# ---------------------------------------------------------------------------------------------
class _Stop(Exception):
    """The stop file exists: the loop ends after the inference that saw it."""


def child(name: str, result: str, pace_ms: float, runs: int, stop: str | None) -> NoReturn:
    import runpy

    script = APPS / f"{name}.py"
    sys.argv = [str(script), "--runs", str(runs if stop is None else 10**9)]
    if pace_ms > 0:
        sys.argv += ["--pace", str(pace_ms)]
    sys.path.insert(0, str(APPS))
    import appkit  # imports torch: the shim (if any) activates here

    shim_mod = sys.modules.get("rrtod.shim.activate")
    itc = shim_mod.interceptor() if shim_mod is not None else None
    state: dict[str, Any] = {"t0": 0.0, "replays": 0, "mismatches": 0, "told": False}
    records: list[list[float]] = []  # [end (monotonic s), latency ms, replayed 0/1]
    real_main, real_describe = appkit.main, appkit.describe

    def timed_input(make: Any) -> Any:
        def make_input(i: int) -> Any:
            x = make(i)  # "grab a frame": untimed
            state["t0"] = time.perf_counter()
            return x
        return make_input

    def describe(index: int, outputs: Any) -> list[str]:
        lines = real_describe(index, outputs)  # reads (downloads) every output
        t1 = time.perf_counter()
        end = time.monotonic()
        replayed = 0
        if itc is not None:
            s = itc.stats()
            r, m = s.get("replays", 0) or 0, s.get("mismatches", 0) or 0
            replayed = int(r == state["replays"] + 1 and m == state["mismatches"])
            state["replays"], state["mismatches"] = r, m
        records.append([round(end, 6), round((t1 - state["t0"]) * 1e3, 4), replayed])
        if replayed and not state["told"]:
            state["told"] = True
            print(MARK + json.dumps({"replaying": index + 1, "t": end}), flush=True)
        if stop is not None and os.path.exists(stop):
            raise _Stop
        return lines

    def main(build: Any, make_input: Any, mode: str = "no_grad", runs: int = 3,
             post: Any = None) -> None:
        real_main(build, timed_input(make_input), mode, runs, post)  # appkit reads --runs

    appkit.main, appkit.describe = main, describe
    with contextlib.suppress(_Stop):
        runpy.run_path(str(script), run_name="__main__")
    Path(result).write_text(json.dumps({"records": records, "offloaded": itc is not None,
                                        "pid": os.getpid()}))
    # Python's exit handlers (the shim's: its last marks, its stats line), then no C++ static
    # destructors: torch's operator deregistration took seconds of CPU per process at exit,
    # N processes at once. The session ends with the socket, as at any exit.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# Pure figures (tests/test_bench_capacity.py)
# ---------------------------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between ranks."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def window_figures(sessions: list[list[list[float]]], t0: float, t1: float) -> dict[str, Any]:
    """Latency and replay figures over the inferences of every session that ended in
    [t0, t1] (each session: records [end, ms, replayed])."""
    lat: list[float] = []
    replayed = 0
    per_session_p99: list[float] = []
    silent = 0  # sessions with no inference in the window
    for recs in sessions:
        mine = [r for r in recs if t0 <= r[0] <= t1]
        if not mine:
            silent += 1
            continue
        lat += [r[1] for r in mine]
        replayed += sum(int(r[2]) for r in mine)
        p = percentile([r[1] for r in mine], 99)
        assert p is not None
        per_session_p99.append(p)
    n = len(lat)
    span = max(t1 - t0, 1e-9)

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 3)

    return {"inferences": n, "seconds": round(span, 3),
            "per_second": round(n / span, 2),
            "per_session_per_second": round(n / span / len(sessions), 3) if sessions else None,
            "replay_share": round(replayed / n, 4) if n else None,
            "latency_ms": {"p50": r(percentile(lat, 50)), "p90": r(percentile(lat, 90)),
                           "p99": r(percentile(lat, 99)), "max": r(max(lat) if lat else None),
                           "mean": r(sum(lat) / n if n else None)},
            "session_p99_ms": {"min": r(min(per_session_p99, default=None)),
                               "median": r(percentile(per_session_p99, 50)),
                               "max": r(max(per_session_p99, default=None))},
            "sessions_without_inference": silent}


def memory_figures(idle: int | None, loaded: list[int], after: int | None,
                   sessions: int) -> dict[str, Any]:
    """The GPU daemon's RSS: idle, at N sessions (median and max of the samples), after they
    ended, and bytes per session ((median at N - idle) / N)."""
    med = percentile([float(x) for x in loaded], 50) if loaded else None
    per = (med - idle) / sessions if med is not None and idle is not None and sessions else None
    return {"idle": idle, "loaded_median": None if med is None else int(med),
            "loaded_max": max(loaded) if loaded else None, "after": after,
            "per_session": None if per is None else int(per)}


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
class App:
    """One app process under rrto-run: its stdout read by a thread (markers, the app's lines),
    its stderr in a file (the shim's stats line)."""

    def __init__(self, index: int, cmd: list[str], env: dict[str, str], result: Path,
                 errfile: Path):
        self.index = index
        self.result = result
        self.errfile = errfile
        self.replaying_at: float | None = None
        self.lines = 0
        with open(errfile, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=err, text=True, cwd=str(REPO), env=env)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                msg = json.loads(line[len(MARK):])
                if "replaying" in msg:
                    self.replaying_at = msg["t"]
            else:
                self.lines += 1

    def stderr(self) -> str:
        return self.errfile.read_text(errors="replace") if self.errfile.exists() else ""

    def records(self) -> list[list[float]]:
        if not self.result.exists():
            return []
        return json.loads(self.result.read_text())["records"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _proc(pid: int) -> Any:
    import psutil

    return psutil.Process(pid)


def _cpu_s(p: Any) -> float:
    t = p.cpu_times()
    return t.user + t.system


def _pss(p: Any) -> int:
    try:
        return p.memory_full_info().pss
    except Exception:  # noqa: BLE001 - an app that ended, or no smaps
        return 0


def _uss(p: Any) -> int | None:
    try:
        return p.memory_full_info().uss
    except Exception:  # noqa: BLE001 - USS needs /proc/PID/smaps: optional
        return None


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.gpu: Any = None
        self.robots: list[Any] = []
        self.apps: list[App] = []
        self.env = app_env(**PROCESS_ENV, **APP_ENV, OMP_NUM_THREADS=str(args.threads))
        # The apps import the rrtod this bench runs (a caller's PYTHONPATH, e.g. a worktree).
        if os.environ.get("PYTHONPATH"):
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]

    def start_daemons(self, stack: contextlib.ExitStack) -> None:
        from testkit.daemons import Launcher

        a = self.args
        env = {"RRTO_OFFLOAD": "0", **PROCESS_ENV, "OMP_NUM_THREADS": str(a.threads)}
        launcher = stack.enter_context(Launcher(extra_env=env))
        log = {"format": "json", "level": "info"}
        executor: dict[str, Any] = {"max_sessions": a.limit} if a.limit else {}
        self.gpu = launcher.start("gpu", roles=["gpu"], log=log, executor=executor)
        hosts = [{"name": "gpu", "address": self.gpu.listen}]
        self.robots = [launcher.start(f"robot{k}", roles=["robot"], log=log, hosts=hosts,
                                      health=HEALTH, wait=False) for k in range(a.robots)]
        for robot in self.robots:
            robot.wait_notify("READY=1")
            robot.wait_for(lambda s: s["hosts"] and s["hosts"][0]["state"] == "up",
                           timeout=60, what="GPU host up")

    def ctl(self, daemon: Any, command: str = "status") -> Any:
        from rrtod.ctl import request

        return request(daemon.socket, command, {})

    def app_cmd(self, index: int, runs: int, stop: Path | None) -> tuple[list[str], Path, Path]:
        result = self.tmp / f"app{index}.json"
        cmd = [str(BIN / "rrto-run"), "--", sys.executable, "-m", "bench.capacity",
               "--child", self.args.app, "--result", str(result),
               "--pace-ms", str(self.args.pace_ms), "--runs", str(runs)]
        if stop is not None:
            cmd += ["--stop", str(stop)]
        return cmd, result, self.tmp / f"app{index}.err"

    def launch(self, index: int, stop: Path) -> App:
        robot = self.robots[index % len(self.robots)]
        cmd, result, err = self.app_cmd(index, 0, stop)
        return App(index, cmd, {**self.env, **robot.env, "RRTO_FALLBACK": "error"}, result, err)

    def probe(self, index: int, fallback: str) -> dict[str, Any]:
        """One app more, for a few inferences, under ``fallback``: refused or served?"""
        robot = self.robots[index % len(self.robots)]
        cmd, result, err = self.app_cmd(index, 3, None)
        env = {**self.env, **robot.env, "RRTO_FALLBACK": fallback}
        t0 = time.monotonic()
        try:
            out = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True,
                                 timeout=self.args.timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"fallback": fallback, "returncode": None, "error": "timed out"}
        stderr = out.stderr
        stats = shim_stats(stderr)
        why = [x for x in stderr.splitlines()
               if "HOST_REFUSED" in x or "rrto:" in x][-1:]
        doc = json.loads(result.read_text()) if result.exists() else {}
        return {"fallback": fallback, "returncode": out.returncode,
                "seconds": round(time.monotonic() - t0, 2),
                "refused": "HOST_REFUSED" in stderr, "message": why[0][:500] if why else None,
                "offloaded": stats is not None, "inferences": len(doc.get("records", [])),
                "printed_lines": len([x for x in out.stdout.splitlines()
                                      if x and not x.startswith(MARK)]),
                "stderr_tail": [x for x in stderr.splitlines()
                                if not x.startswith(STATS_PREFIX)][-6:]}


def _rss(p: Any) -> int:
    return p.memory_info().rss


def run(args: argparse.Namespace) -> dict[str, Any]:
    import psutil

    n = args.sessions
    started = time.time()
    doc: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "command": " ".join(["python -m bench.capacity", *args.argv]),
        "machine": _machine(), "git": _git(),
        "plan": {"sessions": n, "app": args.app, "pace_ms": args.pace_ms,
                 "window_s": args.window_s, "robots": args.robots, "limit": args.limit,
                 "threads": args.threads, "batch": args.batch, "robot_health": HEALTH,
                 "process_env": PROCESS_ENV, "app_env": APP_ENV},
        "loadavg": {"start": [round(x, 2) for x in os.getloadavg()]},
        "memory": {"available_start": psutil.virtual_memory().available},
        "problems": [],
    }
    problems: list[str] = doc["problems"]
    with tempfile.TemporaryDirectory(prefix="rrto-capacity-") as tmp, \
            contextlib.ExitStack() as stack:
        b = Bench(args, Path(tmp))
        b.start_daemons(stack)
        gpu_p = _proc(b.gpu.proc.pid)
        robot_ps = [_proc(r.proc.pid) for r in b.robots]
        time.sleep(1.0)
        idle_rss, idle_uss = _rss(gpu_p), _uss(gpu_p)
        stop = Path(tmp) / "stop"
        stack.callback(lambda: [a.stop() for a in b.apps])
        t_launch = time.monotonic()
        deadline = t_launch + args.timeout_s
        # A ramp: a batch of apps, then wait until each of them replays (or has died) before
        # the next batch, so the torch imports and recording phases of N apps (seconds of CPU
        # each) do not all compete at once. Every app must replay before the window opens.
        for first in range(0, n, args.batch):
            b.apps += [b.launch(i, stop) for i in range(first, min(n, first + args.batch))]
            while time.monotonic() < deadline and not all(
                    a.replaying_at is not None or a.proc.poll() is not None for a in b.apps):
                time.sleep(0.25)
        doc["startup_s"] = round(time.monotonic() - t_launch, 1)
        doc["replaying_at_window"] = sum(a.replaying_at is not None and a.proc.poll() is None
                                         for a in b.apps)
        early = {a.index for a in b.apps if a.proc.poll() is not None}
        for a in b.apps:
            if a.index in early:
                problems.append(f"app {a.index} exited {a.proc.returncode} before the window: "
                                + " | ".join(a.stderr().splitlines()[-3:]))
        waiting = [a.index for a in b.apps if a.replaying_at is None and a.proc.poll() is None]
        if waiting:
            problems.append(f"{len(waiting)} of {n} apps had not replayed after "
                            f"{args.timeout_s:.0f} s (apps {waiting[:10]})")
        gstatus = b.ctl(b.gpu)["gpu"]
        doc["gpu_sessions_open"] = len(gstatus["sessions"])
        doc["gpu_max_sessions"] = gstatus.get("max_sessions")
        # The steady window: every session replays (or the wait timed out).
        samples: dict[str, list[Any]] = {"gpu_rss": [], "gpu_uss": [], "gpu_threads": [],
                                         "apps_rss": [], "available": []}
        app_ps = []  # rrto-run execs the app: the pid is the app's
        for a in b.apps:
            with contextlib.suppress(psutil.Error):
                app_ps.append(_proc(a.proc.pid))
        bench_p = _proc(os.getpid())  # this process (sampling) is not "other" load either
        cpu0 = {"gpu": _cpu_s(gpu_p), "robots": [_cpu_s(p) for p in robot_ps],
                "apps": sum(_safe_cpu(p) for p in app_ps), "machine": _busy(),
                "bench": _cpu_s(bench_p)}
        time.sleep(SETTLE_S)  # the last batch's first replays: its searches end
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.window_s:
            samples["gpu_rss"].append(_rss(gpu_p))
            samples["gpu_threads"].append(gpu_p.num_threads())
            samples["available"].append(psutil.virtual_memory().available)
            if len(samples["gpu_uss"]) < 3:  # smaps is slow to read: a few samples
                samples["gpu_uss"].append(_uss(gpu_p))
            samples["apps_rss"].append(sum(_safe_rss(p) for p in app_ps))
            time.sleep(min(SAMPLE_S, max(0.0, args.window_s - (time.monotonic() - t0))))
        t1 = time.monotonic()
        cpu1 = {"gpu": _cpu_s(gpu_p), "robots": [_cpu_s(p) for p in robot_ps],
                "apps": sum(_safe_cpu(p) for p in app_ps), "machine": _busy(),
                "bench": _cpu_s(bench_p)}
        span = t1 - t0
        # PSS shares each page among the processes that map it (torch's libraries): what the
        # apps really cost. Read once, after the window: smaps of N processes is slow to read.
        apps_pss = sum(_pss(p) for p in app_ps)
        ours = (cpu1["gpu"] - cpu0["gpu"] + sum(cpu1["robots"]) - sum(cpu0["robots"])
                + cpu1["apps"] - cpu0["apps"] + cpu1["bench"] - cpu0["bench"])
        doc["cpu_percent"] = {
            "gpu_daemon": round((cpu1["gpu"] - cpu0["gpu"]) / span * 100, 1),
            "robot_daemons": [round((x1 - x0) / span * 100, 1)
                              for x0, x1 in zip(cpu0["robots"], cpu1["robots"], strict=True)],
            "apps": round((cpu1["apps"] - cpu0["apps"]) / span * 100, 1),
            "bench": round((cpu1["bench"] - cpu0["bench"]) / span * 100, 1),
            "machine_busy": round((cpu1["machine"] - cpu0["machine"]) / span * 100, 1),
            "other_processes": round(max(0.0, (cpu1["machine"] - cpu0["machine"] - ours))
                                     / span * 100, 1),
            "capacity": 100 * (os.cpu_count() or 1),
        }
        status = b.ctl(b.gpu)["gpu"]
        live = [s.get("bytes_live", 0) for s in status["sessions"]]
        doc["gpu_status"] = {"sessions": len(status["sessions"]),
                             "max_sessions": status.get("max_sessions"),
                             "bytes_live_per_session": int(sum(live) / len(live)) if live else None,
                             "replays": sum(s.get("replays", 0) for s in status["sessions"]),
                             "aborts": sum(s.get("aborts", 0) for s in status["sessions"])}
        # One app more: refused (limit) or served (no limit); the N go on meanwhile.
        t_probe = time.monotonic()
        doc["extra_app"] = [b.probe(n, f) for f in (("error", "local") if args.limit
                                                    else ("error",))]
        t_after = time.monotonic()
        status = b.ctl(b.gpu)["gpu"]
        doc["extra_app_refused_by_daemon"] = status["refused_sessions"]
        time.sleep(min(AFTER_S, args.window_s))
        t_end = time.monotonic()
        stop.touch()
        for a in b.apps:
            try:
                a.proc.wait(args.timeout_s)
            except subprocess.TimeoutExpired:
                problems.append(f"app {a.index} did not stop: killed")
                a.stop()
        for robot in b.robots:
            with contextlib.suppress(Exception):
                robot.wait_for(lambda s: not s["sessions"], timeout=30, what="sessions closed")
        with contextlib.suppress(Exception):
            b.gpu.wait_for(lambda s: not s["gpu"]["sessions"], timeout=30, what="closed")
        time.sleep(1.0)
        after_rss = _rss(gpu_p)
        sessions = [a.records() for a in b.apps]
        for a in b.apps:
            if a.index in early:
                continue
            if a.proc.returncode not in (0, None):
                problems.append(f"app {a.index} exited {a.proc.returncode}: "
                                + " | ".join(a.stderr().splitlines()[-4:]))
            stats = shim_stats(a.stderr())
            if stats is None:
                problems.append(f"app {a.index}: no shim stats (not offloaded?)")
            elif stats.get("failed") or stats.get("dropped"):
                problems.append(f"app {a.index}: shim failed={stats.get('failed')} "
                                f"dropped={stats.get('dropped')}")
        doc["window"] = window_figures(sessions, t0, t1)
        done = doc["window"]["inferences"]
        cpu = doc["cpu_percent"]
        # CPU per inference in the window (ms): what each process costs a replayed inference.
        doc["cpu_ms_per_inference"] = None if not done else {
            "gpu_daemon": round(cpu["gpu_daemon"] / 100 * span / done * 1e3, 3),
            "robot_daemons": round(sum(cpu["robot_daemons"]) / 100 * span / done * 1e3, 3),
            "app": round(cpu["apps"] / 100 * span / done * 1e3, 3)}
        doc["during_extra_app"] = window_figures(sessions, t_probe, t_after)
        doc["after_extra_app"] = window_figures(sessions, t_after, t_end)
        doc["gpu_rss"] = memory_figures(idle_rss, samples["gpu_rss"], after_rss, n)
        uss = [x for x in samples["gpu_uss"] if x is not None]
        doc["gpu_uss"] = memory_figures(idle_uss, uss, None, n)
        doc["gpu_threads"] = {"max": max(samples["gpu_threads"], default=None)}
        doc["apps_rss"] = {"total_max": max(samples["apps_rss"], default=None),
                           "per_app": int(max(samples["apps_rss"]) / n)
                           if samples["apps_rss"] and n else None,
                           "pss_total": apps_pss,
                           "pss_per_app": int(apps_pss / n) if apps_pss and n else None}
        doc["memory"]["available_min"] = min(samples["available"], default=None)
        doc["robot_logs"] = [_warnings(r.logs()) for r in b.robots]
        doc["gpu_log"] = _warnings(b.gpu.logs())
    doc["loadavg"]["end"] = [round(x, 2) for x in os.getloadavg()]
    doc["duration_s"] = round(time.time() - started, 1)
    problems += check(doc)
    return doc


def check(doc: dict[str, Any]) -> list[str]:
    """What the run must show; each failure as a sentence."""
    out = []
    n = doc["plan"]["sessions"]
    w = doc["window"]
    if doc.get("gpu_sessions_open") != n:
        out.append(f"the GPU daemon had {doc.get('gpu_sessions_open')} sessions open, not {n}")
    if w["sessions_without_inference"]:
        out.append(f"{w['sessions_without_inference']} sessions ran no inference in the window")
    if w["replay_share"] is not None and w["replay_share"] < 1.0:
        out.append(f"only {w['replay_share']:.2%} of the window's inferences were replayed")
    after = doc.get("after_extra_app") or {}
    if after.get("sessions_without_inference"):
        out.append("after the extra app, some sessions ran no inference")
    limit = doc["plan"]["limit"]
    for probe in doc.get("extra_app", []):
        if limit:
            if not probe.get("refused"):
                out.append(f"app {n + 1} under fallback {probe['fallback']} was not refused")
            elif probe["fallback"] == "error" and probe.get("returncode") == 0:
                out.append(f"app {n + 1} under fallback error was refused but exited 0")
            elif probe["fallback"] == "local" and probe.get("returncode") != 0:
                out.append(f"app {n + 1} under fallback local did not run locally")
        elif probe.get("refused") or probe.get("returncode") != 0:
            out.append(f"app {n + 1} was not served although no limit is configured")
    return out


def _busy() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + \
        getattr(t, "steal", 0)


def _safe_cpu(p: Any) -> float:
    try:
        return _cpu_s(p)
    except Exception:  # noqa: BLE001 - an app that ended
        return 0.0


def _safe_rss(p: Any) -> int:
    try:
        return _rss(p)
    except Exception:  # noqa: BLE001
        return 0


def _warnings(text: str) -> dict[str, Any]:
    """A daemon log's warning and error events, counted by event, and the first few."""
    counts: dict[str, int] = {}
    first: list[str] = []
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("level") in ("warning", "error", "critical"):
            key = str(ev.get("event"))
            counts[key] = counts.get(key, 0) + 1
            if len(first) < 3:
                first.append(line[:400])
    return {"counts": counts, "first": first}


def _machine() -> dict[str, Any]:
    import platform

    import psutil
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "memory_total": psutil.virtual_memory().total, "python": platform.python_version()}


def _git() -> dict[str, Any]:
    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO)
        return out.stdout.rstrip("\n")
    changed = [x[3:] for x in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {"commit": git("rev-parse", "HEAD") or None, "changed": changed}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f} MiB"


def render(doc: dict[str, Any]) -> str:
    p, w = doc["plan"], doc["window"]
    lat, cpu = w["latency_ms"], doc["cpu_percent"]
    rss = doc["gpu_rss"]
    lines = [
        f"# Capacity: {p['sessions']} concurrent replaying sessions on one GPU daemon", "",
        f"`{doc['command']}` — {doc['started']}, {doc['duration_s']} s; "
        f"{doc['machine']['cpu_count']} CPUs, {doc['machine']['memory_total'] / 2**30:.0f} GiB; "
        f"commit {(doc['git']['commit'] or '?')[:10]}"
        + (" (uncommitted changes)" if doc["git"]["changed"] else "") + ".", "",
        f"App `{p['app']}` (tests/apps), one process and one session each, paced "
        f"{p['pace_ms']} ms after each inference; {p['robots']} robot daemon(s), "
        f"1 GPU daemon (`executor.max_sessions: {p['limit'] or 'null'}`); "
        f"{p['threads']} intra-op thread(s) per process. {doc['replaying_at_window']} of "
        f"{p['sessions']} apps replaying after {doc['startup_s']} s (started in batches of "
        f"{p['batch']}, each once the previous one replayed); steady window {w['seconds']} s.",
        "",
        "| figure | value |", "|---|---|",
        f"| sessions open on the GPU daemon | {doc['gpu_sessions_open']} |",
        f"| inferences in the window | {w['inferences']} ({w['per_second']}/s, "
        f"{w['per_session_per_second']}/s per session) |",
        f"| replay share | {_pct(w['replay_share'])} |",
        f"| latency p50 / p90 / p99 / max | {lat['p50']} / {lat['p90']} / {lat['p99']} / "
        f"{lat['max']} ms |",
        f"| per-session p99: min / median / max | {w['session_p99_ms']['min']} / "
        f"{w['session_p99_ms']['median']} / {w['session_p99_ms']['max']} ms |",
        f"| GPU daemon RSS idle → at {p['sessions']} sessions (median, max) → after | "
        f"{_mb(rss['idle'])} → {_mb(rss['loaded_median'])}, {_mb(rss['loaded_max'])} → "
        f"{_mb(rss['after'])} |",
        f"| GPU daemon memory per session (RSS; USS) | {_kb(rss['per_session'])}; "
        f"{_kb(doc['gpu_uss']['per_session'])} |",
        f"| tensors held per session on the GPU daemon (bytes_live) | "
        f"{doc['gpu_status']['bytes_live_per_session']} B |",
        f"| GPU daemon threads (max) | {doc['gpu_threads']['max']} |",
        f"| CPU: GPU daemon / robot daemon(s) / apps / this bench / other processes | "
        f"{cpu['gpu_daemon']}% / {', '.join(f'{x}%' for x in cpu['robot_daemons'])} / "
        f"{cpu['apps']}% / {cpu['bench']}% / {cpu['other_processes']}% of "
        f"{cpu['capacity']}% |",
        "| CPU per inference: GPU daemon / robot daemon(s) / app | "
        + (" / ".join(f"{v} ms" for v in doc["cpu_ms_per_inference"].values())
           if doc.get("cpu_ms_per_inference") else "-") + " |",
        f"| apps' memory: RSS (sum) / PSS (sum) | {_mb(doc['apps_rss']['total_max'])} "
        f"({_mb(doc['apps_rss']['per_app'])} per app) / {_mb(doc['apps_rss']['pss_total'])} "
        f"({_mb(doc['apps_rss']['pss_per_app'])} per app) |",
        f"| memory available: start / lowest | {_mb(doc['memory']['available_start'])} / "
        f"{_mb(doc['memory']['available_min'])} |",
        f"| load average start → end | {doc['loadavg']['start']} → {doc['loadavg']['end']} |",
        "",
    ]
    if doc.get("extra_app"):
        lines += [f"App {p['sessions'] + 1} (started while the {p['sessions']} run):", "",
                  "| fallback | exit | refused | ran | message |", "|---|---|---|---|---|"]
        for probe in doc["extra_app"]:
            msg = (probe.get("message") or "").replace("|", "\\|")
            lines.append(f"| {probe['fallback']} | {probe.get('returncode')} | "
                         f"{probe.get('refused')} | {probe.get('inferences')} inferences"
                         f"{' offloaded' if probe.get('offloaded') else ''} | `{msg}` |")
        aft = doc["after_extra_app"]
        lines += ["", f"During it the {p['sessions']} sessions ran "
                      f"{doc['during_extra_app']['inferences']} inferences "
                      f"(replay share {_pct(doc['during_extra_app']['replay_share'])}, "
                      f"p99 {doc['during_extra_app']['latency_ms']['p99']} ms); after it "
                      f"{aft['inferences']} (replay share {_pct(aft['replay_share'])}, "
                      f"sessions without an inference: {aft['sessions_without_inference']}). "
                      f"Refusals counted by the GPU daemon: {doc['extra_app_refused_by_daemon']}.",
                  ""]
    lines += ["## Problems", ""] + ([f"- {x}" for x in doc["problems"]] or ["- none"])
    return "\n".join(lines) + "\n"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2%}"


def _kb(v: int | None) -> str:
    return "-" if v is None else f"{v / 1024:.0f} KiB"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.capacity",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=64, help="concurrent app processes (N)")
    p.add_argument("--app", default="mlp_policy", help="a test app of tests/apps")
    p.add_argument("--pace-ms", type=float, default=500.0,
                   help="sleep after each inference (a sensor-paced loop)")
    p.add_argument("--window-s", type=float, default=30.0, help="steady window")
    p.add_argument("--robots", type=int, default=1, help="robot daemons (apps in turn)")
    p.add_argument("--limit", type=int, default=None,
                   help="executor.max_sessions of the GPU daemon (default: N)")
    p.add_argument("--no-limit", action="store_true",
                   help="no session limit: app N+1 must be served")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--batch", type=int, default=8,
                   help="apps started together; the next batch once these replay")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="until every app replays; per extra app")
    p.add_argument("--out", type=Path, default=RESULTS, help="capacity.json / capacity.md here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.result, args.pace_ms, args.runs, args.stop)
    if args.sessions < 1 or args.robots < 1 or args.window_s <= 0:
        p.error("need --sessions >= 1, --robots >= 1, --window-s > 0")
    if not (APPS / f"{args.app}.py").exists():
        p.error(f"unknown app {args.app!r} (tests/apps)")
    args.limit = None if args.no_limit else (args.limit or args.sessions)
    args.argv = argv
    for k, v in PROCESS_ENV.items():
        os.environ.setdefault(k, v)
    doc = run(args)
    md = render(doc)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity.json").write_text(json.dumps(doc, indent=1, default=str))
    (args.out / "capacity.md").write_text(md)
    print(md)
    return 1 if doc["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
