"""``python -m bench.fleet``: robots sharing GPU hosts of different speeds over different links,
each host balancer under RILaaS-style load profiles.

    python -m bench.fleet [--quick] [--balancers a,b] [--profiles p,q] [--app resnet]
                          [--robots 4] [--host-cpus 1,0.5,0.25] [--links cloud,wifi6-edge,edge]
                          [--duration-s 30] [--rate-scale 1] [--warmup 8] [--deadline-ms MS]
                          [--chaos] [--robot-config KEY=VALUE ...] [--out DIR]

The scenario, all on this machine (docs/benchmark.md, "Fleet"):

- **GPU hosts.** ``len(--host-cpus)`` GPU daemons (``roles: [gpu]``), each in a CPU cgroup of
  its own (v1 ``cpu`` controller, ``demo.machines.Group``) with a CFS quota of that many CPUs, at
  the shortest period the kernel allows for it, so that each inference is slowed and not only
  sustained load. What that gives is measured, not assumed: the app's model is run in each
  group (``appkit --hold-mid``: the process imports and warms up outside, then is moved in) and
  its per-inference time reported, and during every cell each daemon's CPU time per replayed
  inference. Without root or cgroup v1 the hosts run unthrottled and the report says why.
- **Links.** Each host sits behind its own emulated link (``bench.link``: a user-space proxy with
  delay and rate), measured at start (RTT, throughput up and down) through the same proxy.
- **Robots.** ``--robots`` robot daemons (``roles: [robot]``), one per robot, each with the
  balancer under test (``balancer: NAME``) and every host listed in the same order, and one
  unmodified test app each (``tests/apps/APP.py`` under ``rrto-run``, ``fallback: local``,
  ``RRTO_STATS=1``). ``--robot-config KEY=VALUE`` (dotted keys, YAML values) is merged into each
  robot daemon's config (e.g. ``placement=inference``, ``balancers.q-learning.epsilon=0.1``).
- **Load.** Each app runs ``--warmup`` inferences (recording, then replay), then follows a
  schedule (``appkit --schedule``): one inference at each arrival time of the profile,
  open-loop: a late app does not shift later arrivals. Latency is from arrival to the last
  output read (queueing in the app included); the model call alone is reported too.

Per balancer the robot daemons are started once and live through its profiles, in the order
given (a learning balancer carries what it learnt from one to the next, as RILaaS trains on the
first four profiles and tests on the sinusoidal one); per (balancer, profile) the apps are
started afresh. Reported per cell: p50/p99 latency, throughput, each host's share of the
inferences (the robot daemons' ``rrtoctl status``: per session its host, or its ``placements``
where the daemon places inferences one by one), failovers and local fallbacks (the robot
daemons' counters where they report them, else the shim's), deadline misses, app errors and
frames that differ from a local run of the same frames (the last two must be 0).
``--chaos`` kills (and restarts) or stops GPU daemons at random during each cell
(``bench.chaos.HostFaults``), never leaving fewer than one host up.

Writes ``fleet.json`` and ``fleet.md`` (``fleet-chaos.*`` with ``--chaos``) to ``--out``
(default bench/results). Exit 1 when an app erred, a frame differed or a cell failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.capacity import _git, _machine, percentile
from bench.chaos import HEALTH as CHAOS_HEALTH
from bench.chaos import HostFaults
from bench.link import LINKS, LinkProcess, LinkSpec, MeasureServer, measure
from testkit.apps import APPS, DAEMON_ENV, app_env, shim_stats
from testkit.daemons import BIN, Launcher, free_port

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# Every process of the run: no OpenMP spinning between inferences, and one intra-op thread, the
# same in the GPU daemons, the apps and the local reference run (a different split of the work
# rounds differently), and so that a host's quota is its speed.
PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
BALANCERS = ("round-robin", "least-connections", "least-model-time", "q-learning")
PROFILE_ORDER = ("uniform", "step", "spike", "poisson", "sinusoidal")
# Links beside bench.link's: a far, well-provisioned cloud host and a near edge box.
FLEET_LINKS: dict[str, LinkSpec] = {
    **LINKS,
    "cloud": LinkSpec("cloud", rtt_ms=20.0, mbps=100.0),
    "edge": LinkSpec("edge", rtt_ms=1.0, mbps=450.0),
}
# The fastest host behind the farthest link, the slowest on the nearest: RILaaS's cloud/edge.
HOST_CPUS = (1.0, 0.5, 0.25)
HOST_LINKS = ("cloud", "wifi6-edge", "edge")
# Robot daemons' health checks of the hosts. Without chaos nothing is faulted: a slow answer
# from a throttled host on this loaded 2-core machine must not fail its sessions. With chaos,
# bench.chaos's (a stalled host is down within 1.5 s).
HEALTH = {"interval": 0.5, "timeout": 2.0, "down_after": 3}
LOG = {"format": "json", "level": "info"}
POLL_S = 0.5  # robot daemons' status, during a cell
# Counters a robot daemon's session may report (per-inference placement: in its ``placement``
# block), summed per cell.
ROBOT_COUNTERS = ("failovers", "local_fallbacks", "moved", "late", "pulled", "resends",
                  "deadline_misses")
# The shim's counters (``rrto-stats``) summed per cell. (Not its ``replays``: they restart at
# each reconnect; the replayed share comes from its per-inference record.)
SHIM_COUNTERS = ("hosts_lost", "reconnects", "recoveries", "deadline_misses", "local_ops",
                 "local_fallbacks", "failovers")


# ---------------------------------------------------------------------------------------------
# Load profiles (RILaaS, section VI-C), per robot, in requests per second
# ---------------------------------------------------------------------------------------------
PROFILES: dict[str, dict[str, Any]] = {
    "uniform": {"rate": 8.0},
    "step": {"rates": [2.0, 4.0, 6.0, 8.0]},  # equal quarters of the duration
    "spike": {"rate": 2.0, "extra": 13.0, "spike_s": 2.0},  # the spike centred in the duration
    "poisson": {"rate": 8.0},
    "sinusoidal": {"mean": 6.0, "amplitude": 4.0, "hz": 0.05},
}


def rate_at(profile: str, t: float, duration: float, scale: float = 1.0) -> float:
    """The profile's request rate (per second, one robot) at ``t`` seconds into ``duration``."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}")
    p = PROFILES[profile]
    if profile in ("uniform", "poisson"):
        r = p["rate"]
    elif profile == "step":
        steps = p["rates"]
        r = steps[min(int(t / (duration / len(steps))), len(steps) - 1)]
    elif profile == "spike":
        half = min(p["spike_s"], duration) / 2
        r = p["rate"] + (p["extra"] if abs(t - duration / 2) < half else 0.0)
    else:  # sinusoidal
        r = p["mean"] + p["amplitude"] * math.sin(2 * math.pi * p["hz"] * t)
    return max(0.0, r * scale)


def arrivals(profile: str, duration: float, phase: float = 0.0, seed: str = "",
             scale: float = 1.0, step_s: float = 0.001) -> list[float]:
    """Arrival times (seconds from the start) of one robot's requests. ``poisson``: a Poisson
    process (exponential gaps, seeded by ``seed``, which each robot has its own of); the others
    deterministic: a request each time
    the integral of the rate passes an integer plus ``phase`` (in [0, 1): robots are staggered so
    that they do not all arrive at the same instant)."""
    out: list[float] = []
    if profile == "poisson":
        rng = random.Random(f"{seed}/{profile}")
        rate = rate_at(profile, 0.0, duration, scale)
        t = rng.expovariate(rate) if rate > 0 else duration
        while rate > 0 and t < duration:
            out.append(round(t, 6))
            t += rng.expovariate(rate)
        return out
    area, t, k = 0.0, 0.0, 0
    while t < duration:
        if area >= k + phase:
            out.append(round(t, 6))
            k += 1
            continue
        area += rate_at(profile, t + step_s / 2, duration, scale) * step_s
        t += step_s
    return out


def profile_text(profile: str, scale: float) -> str:
    p = PROFILES[profile]

    def s(v: float) -> str:
        return f"{v * scale:g}"
    return {
        "uniform": lambda: f"{s(p['rate'])}/s",
        "step": lambda: " → ".join(s(r) for r in p["rates"]) + "/s, equal quarters",
        "spike": lambda: f"{s(p['rate'])}/s, + {s(p['extra'])}/s for {p['spike_s']:g} s mid-run",
        "poisson": lambda: f"Poisson process, mean {s(p['rate'])}/s",
        "sinusoidal": lambda: f"{s(p['mean'])} ± {s(p['amplitude'])}/s at {p['hz']:g} Hz",
    }[profile]()


# ---------------------------------------------------------------------------------------------
# Pure figures (tests/test_bench_fleet.py)
# ---------------------------------------------------------------------------------------------
def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` items (dotted keys, YAML values) as one nested dict."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--robot-config {item!r}: expected KEY=VALUE")
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--robot-config {item!r}: {part} is not a mapping")
        node[parts[-1]] = yaml.safe_load(value)
    return out


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, mappings key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _flat(session: dict[str, Any]) -> dict[str, Any]:
    """A session's describe() with its ``placement`` block (per-inference placement:
    ``placements``, ``failovers``, ...), if any, lifted to the top."""
    block = session.get("placement")
    return {**session, **block} if isinstance(block, dict) else session


def placements(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
               ) -> tuple[dict[str, int], dict[str, int]]:
    """Inferences per host between two views of the robot daemons' sessions (by a key unique
    per session; a session that appeared in between starts from nothing), and the sums of the
    sessions' ``ROBOT_COUNTERS`` over the same span (only those some session reports). A session
    with a ``placements`` dict {host: count} (at its top or in its ``placement`` block) is
    counted from it, else all its inferences go to its ``host``."""
    hosts: dict[str, int] = {}
    counters: dict[str, int] = {}
    for key, s in after.items():
        s, b = _flat(s), _flat(before.get(key, {}))
        if isinstance(s.get("placements"), dict):
            old = b.get("placements") if isinstance(b.get("placements"), dict) else {}
            for h, n in s["placements"].items():
                hosts[h] = hosts.get(h, 0) + max(0, int(n) - int(old.get(h, 0)))
        elif s.get("host") is not None:
            n = max(0, int(s.get("inferences", 0)) - int(b.get("inferences", 0)))
            hosts[s["host"]] = hosts.get(s["host"], 0) + n
        for c in ROBOT_COUNTERS:
            if isinstance(s.get(c), int | float):
                counters[c] = counters.get(c, 0) + int(s[c]) - int(b.get(c, 0) or 0)
    return hosts, counters


def latency_figures(runs: list[tuple[list[float], list[tuple[float, float]]]],
                    duration: float) -> dict[str, Any]:
    """Per app (arrival times, the app's ``--times`` of its scheduled inferences): latency from
    arrival to the end (ms), the model call alone (ms), and throughput."""
    resp: list[float] = []
    service: list[float] = []
    first = last = None
    offered = 0
    for sched, times in runs:
        offered += len(sched)
        for at, (began, secs) in zip(sched, times, strict=False):
            end = began + secs
            resp.append((end - at) * 1e3)
            service.append(secs * 1e3)
            first = at if first is None else min(first, at)
            last = end if last is None else max(last, end)

    def r(v: float | None) -> float | None:
        return None if v is None else round(v, 2)

    span = (last - first) if first is not None and last is not None else 0.0
    return {"offered": offered, "done": len(resp),
            "offered_per_s": round(offered / duration, 2) if duration else None,
            "per_s": round(len(resp) / span, 2) if span > 0 else None,
            "p50_ms": r(percentile(resp, 50)), "p90_ms": r(percentile(resp, 90)),
            "p99_ms": r(percentile(resp, 99)), "max_ms": r(max(resp) if resp else None),
            "mean_ms": r(statistics.fmean(resp) if resp else None),
            "model_call_p50_ms": r(percentile(service, 50)),
            "model_call_p99_ms": r(percentile(service, 99))}


def differing(got: list[str], want: list[str]) -> int:
    """Lines of ``got`` that differ from ``want`` at the same position (what ``want`` lacks
    counts as differing)."""
    return sum(1 for k, g in enumerate(got) if k >= len(want) or g != want[k])


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------
def period_us(cpus: float) -> int:
    """The CFS period of a host group of ``cpus``. Below one CPU, the shortest the kernel allows
    (a quota of 1 ms): every burst longer than that is throttled, so each inference is slower,
    not only sustained load (with the default 100 ms period a 2 ms inference passes
    unthrottled). From one CPU on, 10 ms: a 1 ms period made even a 1-CPU group 3x slower than
    no group on this machine (docs/benchmark.md, "Fleet")."""
    return 10_000 if cpus >= 1 else round(1000 / cpus)


class FleetApp:
    """One robot's app under rrto-run: its stdout read by a thread (lines, markers), its stderr
    in a file (the shim's stats line)."""

    def __init__(self, cmd: list[str], env: dict[str, str], errfile: Path):
        self.errfile = errfile
        self.lines: list[str] = []
        self.scheduled = threading.Event()  # printed SCHEDULE: warm-up done
        self.held = threading.Event()  # printed HOLD: schedule done, times written
        with open(errfile, "w") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, cwd=str(APPS), env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if line == "SCHEDULE":
                self.scheduled.set()
            elif line == "HOLD":
                self.held.set()
            elif line:
                self.lines.append(line)
        self.scheduled.set()  # ended: nobody waits for what will not come
        self.held.set()

    def tell(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def stderr(self) -> str:
        return self.errfile.read_text(errors="replace") if self.errfile.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Host:
    name: str
    cpus: float | None  # None: no quota
    link: LinkSpec


def _request(daemon: Any, command: str = "status", timeout: float = 5.0) -> Any:
    from rrtod.ctl import request

    return request(daemon.socket, command, {}, timeout=timeout)


class Fleet:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="rrto-fleet-"))
        self.ports = [free_port() for _ in args.host_cpus]
        self.hosts_def = [Host(f"gpu{k}", c, FLEET_LINKS[name])
                          for k, (c, name) in enumerate(zip(args.host_cpus, args.links,
                                                            strict=True))]
        self.groups: list[Any] = []
        self.cgroups_unavailable: str | None = None
        self.launcher: Launcher | None = None
        self.hosts: HostFaults | None = None
        self.links: list[LinkProcess] = []
        self.env = app_env(**PROCESS_ENV, RRTO_STATS="1", RRTO_FALLBACK="local")
        if args.deadline_ms:
            self.env["RRTO_DEADLINE_MS"] = str(args.deadline_ms)
        # The apps import the rrtod this bench runs (a caller's PYTHONPATH, e.g. a worktree).
        if os.environ.get("PYTHONPATH"):
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        self.problems: list[str] = []

    # -- set-up ---------------------------------------------------------------------------------
    def _gpu(self, k: int) -> Any:
        assert self.launcher is not None
        gpu = self.launcher.start(f"gpu{k}", roles=["gpu"], listen=f"127.0.0.1:{self.ports[k]}",
                                  log=LOG, drain_timeout=3)
        if self.groups:
            self.groups[k].join(gpu.proc.pid)
        return gpu

    def _make_groups(self, stack: contextlib.ExitStack) -> None:
        from demo.machines import SHARES, Group, unavailable

        why = unavailable()
        if why is None and self.args.no_cgroups:
            why = "--no-cgroups"
        if why is not None:
            self.cgroups_unavailable = why
            for h in self.hosts_def:
                h.cpus = None
            return
        for h in self.hosts_def:
            assert h.cpus is not None
            g = Group(Path("/sys/fs/cgroup"), f"rrto-fleet-{h.name}-{os.getpid()}", quota=h.cpus,
                      period_us=period_us(h.cpus), shares=SHARES)
            stack.callback(g.close)
            self.groups.append(g)

    def _measure_links(self, server: MeasureServer) -> list[dict[str, Any]]:
        out = []
        for h, link in zip(self.hosts_def, self.links, strict=True):
            delay = link.calibrate(link.address(1))
            m = measure(link.address(1), h.link, link).to_dict()
            m.pop("rtt_samples_ms", None)
            m["one_way_delay_ms"] = round(delay * 1e3, 3)
            for k in ("rtt_ms", "up_mbps", "down_mbps", "target_rtt_ms", "target_up_mbps",
                      "target_down_mbps"):
                if isinstance(m.get(k), float):
                    m[k] = round(m[k], 3)
            out.append({"host": h.name, **m})
        return out

    def _model_times(self) -> dict[str, Any]:
        """The app's model alone, per host group (and outside any, for reference): each process
        warms up outside, is moved into the group at ``--hold-mid`` and runs as many inferences
        again there, one process at a time."""
        n = self.args.calibrate_runs
        targets: list[tuple[str, Any]] = [("unthrottled", None)]
        targets += [(h.name, self.groups[k] if self.groups else None)
                    for k, h in enumerate(self.hosts_def)]
        procs = []
        for name, _ in targets:
            times = self.tmp / f"model-{name}.json"
            p = subprocess.Popen([sys.executable, str(APPS / f"{self.args.app}.py"), "--runs",
                                  str(2 * n), "--hold-mid", "--times", str(times)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=str(APPS),
                                 env=app_env(**PROCESS_ENV))
            procs.append((p, times))
        for p, _ in procs:  # all warmed up and waiting before any is timed
            assert p.stdout is not None
            for line in p.stdout:
                if line.strip() == "HOLD":
                    break
        out: dict[str, Any] = {}
        for (name, group), (p, times) in zip(targets, procs, strict=True):
            assert p.stdin is not None
            try:
                if group is not None:
                    group.join(p.pid)
                p.stdin.write("go\n")
                p.stdin.flush()
                p.communicate(timeout=300)
                ms = [d * 1e3 for _, d in json.loads(times.read_text())[n:]]
                out[name] = {"p50_ms": round(percentile(ms, 50) or 0, 3),
                             "p90_ms": round(percentile(ms, 90) or 0, 3),
                             "mean_ms": round(statistics.fmean(ms), 3), "runs": len(ms)}
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                out[name] = {"error": repr(exc)}
                if p.poll() is None:
                    p.kill()
                    p.wait()
        ref = out.get("unthrottled", {}).get("p50_ms")
        for v in out.values():
            if ref and v.get("p50_ms"):
                v["slowdown"] = round(v["p50_ms"] / ref, 2)
        return out

    def _local_reference(self, runs: int) -> list[str]:
        out = subprocess.run([sys.executable, str(APPS / f"{self.args.app}.py"), "--runs",
                              str(runs)], env=app_env(**PROCESS_ENV), cwd=str(APPS),
                             capture_output=True, text=True, timeout=600, check=True)
        return [x for x in out.stdout.splitlines() if x]

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        started = time.time()
        doc: dict[str, Any] = {
            "command": a.command, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                          time.gmtime(started)),
            "git": _git(), "machine": _machine(), "process_env": PROCESS_ENV,
            "plan": {"app": a.app, "robots": a.robots, "balancers": a.balancers,
                     "profiles": a.profiles, "duration_s": a.duration_s, "warmup": a.warmup,
                     "rate_scale": a.rate_scale, "seed": a.seed, "chaos": a.chaos,
                     "deadline_ms": a.deadline_ms, "robot_config": a.robot_config,
                     "quick": a.quick},
            "profiles": {p: {"per_robot": profile_text(p, a.rate_scale),
                             "params": PROFILES[p]} for p in a.profiles},
        }
        schedules = {p: [arrivals(p, a.duration_s, phase=r / a.robots,
                                  seed=f"{a.seed}/robot{r}", scale=a.rate_scale)
                         for r in range(a.robots)] for p in a.profiles}
        most = a.warmup + max((len(s) for ss in schedules.values() for s in ss), default=0)
        from rrtod.plugins import discover

        installed = discover().names("balancer")
        skipped = [b for b in a.balancers if b not in installed]
        doc["balancers_installed"] = installed
        doc["balancers_skipped"] = {b: "not installed in this checkout" for b in skipped}
        run_balancers = [b for b in a.balancers if b in installed]
        if not run_balancers:
            raise SystemExit(f"none of the balancers {', '.join(a.balancers)} is installed "
                             f"(installed: {', '.join(installed)})")
        doc["cells"] = []
        with contextlib.ExitStack() as stack:
            self._make_groups(stack)
            self.launcher = stack.enter_context(Launcher(extra_env={**DAEMON_ENV, **PROCESS_ENV}))
            self.hosts = HostFaults(self._gpu, len(self.hosts_def))
            self.hosts.start_all()
            server = MeasureServer()
            stack.callback(server.close)
            for k, h in enumerate(self.hosts_def):
                self.links.append(stack.enter_context(LinkProcess(
                    h.link, [f"127.0.0.1:{self.ports[k]}", server.address])))
            doc["timing_s"] = {"hosts_up": round(time.time() - started, 1)}
            print("measuring links and host speeds ...", flush=True)
            doc["links"] = self._measure_links(server)
            doc["timing_s"]["links"] = round(time.time() - started, 1)
            doc["model_time"] = self._model_times()
            doc["timing_s"]["model_time"] = round(time.time() - started, 1)
            doc["hosts"] = [{"name": h.name, "cpus": h.cpus,
                             "cfs_period_us": period_us(h.cpus) if h.cpus else None,
                             "link": h.link.name, "link_target": {"rtt_ms": h.link.rtt_ms,
                                                                  "mbps": h.link.mbps,
                                                                  "trace": h.link.trace}}
                            for h in self.hosts_def]
            doc["cgroups"] = self.cgroups_unavailable or "v1 cpu controller, one group per host"
            want = self._local_reference(most)
            doc["timing_s"]["local_reference"] = round(time.time() - started, 1)
            doc["robot_daemon_config"] = self._robot_config("NAME")
            for balancer in run_balancers:
                try:
                    robots = self._robots(balancer)
                except RuntimeError as exc:  # e.g. a --robot-config key this rrtod refuses
                    why = " | ".join(str(exc).splitlines()[-3:])
                    self.problems.append(f"{balancer}: robot daemons did not start: {why}")
                    continue
                try:
                    for profile in a.profiles:
                        print(f"cell {balancer} × {profile} ...", flush=True)
                        cell = self._cell(balancer, profile, robots, schedules[profile], want)
                        doc["cells"].append(cell)
                        print(render_row(cell, [h.name for h in self.hosts_def]), flush=True)
                finally:
                    for r in robots:
                        r.stop()
            self.hosts.join()
        doc["duration_s"] = round(time.time() - started, 1)
        cpu = [c.get("host_cpu_ms_per_replay", {}) for c in doc["cells"]]
        for h in doc["hosts"]:
            xs = [c[h["name"]] for c in cpu if c.get(h["name"]) is not None]
            h["cpu_ms_per_replay_median"] = round(statistics.median(xs), 3) if xs else None
        doc["problems"] = self.problems + check(doc)
        return doc

    def _robot_config(self, balancer: str) -> dict[str, Any]:
        """A robot daemon's config (beside ``Launcher``'s own keys): the balancer, every host
        through its link, health checks, then ``--robot-config``."""
        return merged({"roles": ["robot"], "balancer": balancer, "log": LOG, "drain_timeout": 3,
                       "health": CHAOS_HEALTH if self.args.chaos else HEALTH,
                       "hosts": [{"name": h.name, "address": link.address(0)}
                                 for h, link in zip(self.hosts_def, self.links, strict=True)]},
                      self.args.overrides)

    def _robots(self, balancer: str) -> list[Any]:
        assert self.launcher is not None
        cfg = self._robot_config(balancer)
        robots = [self.launcher.start(f"robot{r}", wait=False, **cfg)
                  for r in range(self.args.robots)]
        try:
            for robot in robots:
                robot.wait_notify("READY=1")
            for robot in robots:
                robot.wait_for(lambda s: s["hosts"] and all(h["state"] == "up"
                                                            for h in s["hosts"]),
                               timeout=60, what="every host up")
        except (RuntimeError, TimeoutError) as exc:
            for robot in robots:
                robot.stop()
            raise RuntimeError(str(exc)) from exc
        return robots

    def _snapshot(self, robots: list[Any], into: dict[str, dict[str, Any]]) -> None:
        for r, robot in enumerate(robots):
            try:
                sessions = _request(robot)["sessions"]
            except Exception:  # noqa: BLE001 - busy: the next poll
                continue
            for s in sessions:
                into[f"robot{r}/{s['id']}"] = s

    def _gpu_counters(self) -> dict[str, tuple[int, float] | None]:
        """Per host: (replays over its open sessions, the daemon's CPU seconds), None when down."""
        import psutil

        assert self.hosts is not None
        out: dict[str, tuple[int, float] | None] = {}
        for k, h in enumerate(self.hosts_def):
            gpu = self.hosts.gpus[k]
            try:
                st = _request(gpu)["gpu"]
                t = psutil.Process(gpu.proc.pid).cpu_times()
                out[h.name] = (sum(int(s.get("replays", 0)) for s in st["sessions"]),
                               t.user + t.system)
            except Exception:  # noqa: BLE001 - a host that is down or restarting
                out[h.name] = None
        return out

    def _cell(self, balancer: str, profile: str, robots: list[Any],
              schedules: list[list[float]], want: list[str]) -> dict[str, Any]:
        a = self.args
        assert self.hosts is not None
        tag = f"{balancer}-{profile}"
        cell: dict[str, Any] = {"balancer": balancer, "profile": profile}
        t0 = time.monotonic()
        apps: list[FleetApp] = []
        paths = []
        for r, robot in enumerate(robots):
            sched_path, times_path = self.tmp / f"{tag}-{r}.sched", self.tmp / f"{tag}-{r}.times"
            paths.append((sched_path, times_path))
            cmd = [str(BIN / "rrto-run"), "--", sys.executable, str(APPS / f"{a.app}.py"),
                   "--runs", str(a.warmup), "--schedule", str(sched_path), "--times",
                   str(times_path), "--hold"]
            apps.append(FleetApp(cmd, {**self.env, **robot.env}, self.tmp / f"{tag}-{r}.err"))
        seen: dict[str, dict[str, Any]] = {}
        stop_poll = threading.Event()
        stop_chaos = threading.Event()
        chaos_thread: threading.Thread | None = None
        faults_before = len(self.hosts.faults)
        try:
            deadline = time.monotonic() + a.timeout_s
            for app in apps:
                app.scheduled.wait(max(0.0, deadline - time.monotonic()))
            late = [r for r, app in enumerate(apps) if app.proc.poll() is not None
                    or not app.scheduled.is_set()]
            if late:
                raise RuntimeError(f"apps {late} did not finish their warm-up")
            cell["warmup_s"] = round(time.monotonic() - t0, 1)
            self._snapshot(robots, seen)
            before = {k: dict(v) for k, v in seen.items()}
            gpu0 = self._gpu_counters()
            origin = time.monotonic() + 0.5
            absolute = [[origin + t for t in s] for s in schedules]
            for (sched_path, _), times in zip(paths, absolute, strict=True):
                sched_path.write_text(json.dumps(times))
            for app in apps:
                app.tell("go")
            poller = threading.Thread(target=self._poll, args=(robots, seen, stop_poll),
                                      daemon=True)
            poller.start()
            if a.chaos:
                chaos_thread = threading.Thread(
                    target=self._chaos, args=(stop_chaos, random.Random(f"{a.seed}/{tag}")),
                    daemon=True)
                chaos_thread.start()
            deadline = origin + a.duration_s + a.timeout_s
            for app in apps:
                app.held.wait(max(0.0, deadline - time.monotonic()))
            stop_chaos.set()
            if chaos_thread is not None:
                chaos_thread.join(60)
            stop_poll.set()
            poller.join(10)
            self._snapshot(robots, seen)
            gpu1 = self._gpu_counters()
            hosts, counters = placements(before, seen)
            cell["placements"] = {h.name: hosts.get(h.name, 0) for h in self.hosts_def}
            cell["placements"].update({k: v for k, v in hosts.items() if k not in cell["placements"]})
            cell["robot_counters"] = counters
            cpu = {}
            for name in (h.name for h in self.hosts_def):
                b, e = gpu0.get(name), gpu1.get(name)
                if b is not None and e is not None and e[0] > b[0]:
                    cpu[name] = round((e[1] - b[1]) / (e[0] - b[0]) * 1e3, 3)
                else:
                    cpu[name] = None
            cell["host_cpu_ms_per_replay"] = cpu
        except Exception as exc:  # noqa: BLE001 - the cell fails, the run goes on
            cell["failed"] = repr(exc)
            self.problems.append(f"{balancer} × {profile}: {exc}")
        finally:
            stop_chaos.set()
            stop_poll.set()
            if chaos_thread is not None:
                chaos_thread.join(60)
            for app in apps:
                app.tell("exit")
            for app in apps:
                try:
                    app.proc.wait(60)
                except subprocess.TimeoutExpired:
                    app.kill()
            self.hosts.join()  # every host up again before the next cell
        faults = self.hosts.faults[faults_before:]
        cell["faults"] = [{"host": f["host"], "kind": f.get("kind"),
                           "down_s": round(f["back"] - f["at"], 2) if "back" in f else None}
                          for f in faults]
        self._app_figures(cell, apps, paths, schedules, want)
        cell["wall_s"] = round(time.monotonic() - t0, 1)
        return cell

    def _poll(self, robots: list[Any], seen: dict[str, dict[str, Any]],
              stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            self._snapshot(robots, seen)

    def _chaos(self, stop: threading.Event, rng: random.Random) -> None:
        """Faults at random times (exponential gaps, mean ``--chaos-interval-s``) on a random
        host that is up, while at least one other host is up."""
        a = self.args
        assert self.hosts is not None
        while not stop.wait(rng.expovariate(1 / a.chaos_interval_s)):
            up = [k for k in range(len(self.hosts_def)) if self.hosts.up(k)]
            if len(up) < 2:
                continue
            k, kind = rng.choice(up), rng.choice(a.chaos_faults)
            try:
                if kind == "kill":
                    self.hosts.kill(k, wait=False)
                else:
                    self.hosts.stop(k, a.stall_s)
            except Exception as exc:  # noqa: BLE001 - a host that ended meanwhile
                self.problems.append(f"chaos {kind} gpu{k}: {exc!r}")

    def _app_figures(self, cell: dict[str, Any], apps: list[FleetApp],
                     paths: list[tuple[Path, Path]], schedules: list[list[float]],
                     want: list[str]) -> None:
        a = self.args
        runs = []
        errors = 0
        wrong = 0
        replayed = scheduled = 0
        shim: dict[str, float] = {}
        per_app = []
        for r, (app, (sched_path, times_path)) in enumerate(zip(apps, paths, strict=True)):
            err = app.stderr()
            rc = app.proc.returncode
            e = int(rc not in (0, None)) + err.count("Traceback") + err.count("HostLost")
            times = json.loads(times_path.read_text()) if times_path.exists() else []
            sched = json.loads(sched_path.read_text()) if sched_path.exists() else []
            expected = a.warmup + len(schedules[r])
            done = len({x.split(":", 1)[0] for x in app.lines})  # appkit: "i:k ..." per output
            missing = max(0, expected - done)
            if missing and "failed" not in cell:
                e += 1
            w = differing(app.lines, want)
            stats = shim_stats(err) or {}
            if not stats:
                e += int("failed" not in cell)  # no stats: the shim never ran or crashed
            by = stats.get("by_inference") or {}
            for i, rep in zip(by.get("index", []), by.get("replays", []), strict=False):
                if i >= a.warmup:
                    scheduled += 1
                    replayed += int(rep > 0)
            for k in SHIM_COUNTERS:
                if isinstance(stats.get(k), int | float):
                    shim[k] = shim.get(k, 0) + stats[k]
            runs.append((sched, times[a.warmup:]))
            errors += e
            wrong += w
            per_app.append({"robot": r, "exit": rc, "errors": e, "wrong": w,
                            "inferences": done, "expected": expected,
                            "first_error": next((x for x in err.splitlines()
                                                 if "Error" in x or "Traceback" in x), None)})
        cell["latency"] = latency_figures(runs, a.duration_s)
        # Inferences no host was seen serving: run in the app after a loss, or counted by a
        # session that closed between two polls (chaos).
        if "placements" in cell:
            cell["unplaced"] = max(0, cell["latency"]["done"] - sum(cell["placements"].values()))
        cell["app_errors"] = errors
        cell["wrong_results"] = wrong
        cell["replayed_share"] = round(replayed / scheduled, 4) if scheduled else None
        cell["shim"] = shim
        cell["apps"] = per_app
        rc = cell.get("robot_counters", {})
        cell["failovers"] = ({"value": rc["failovers"], "source": "robot daemons"}
                             if "failovers" in rc else
                             {"value": int(shim.get("failovers", shim.get("reconnects", 0))),
                              "source": "shim" if "failovers" in shim else "shim reconnects"})
        if "local_fallbacks" in rc:
            cell["local_fallbacks"] = {"value": rc["local_fallbacks"], "source": "robot daemons"}
        elif "local_fallbacks" in shim:
            cell["local_fallbacks"] = {"value": int(shim["local_fallbacks"]), "source": "shim"}
        else:
            cell["local_fallbacks"] = {
                "value": int(shim.get("deadline_misses", 0) + shim.get("recoveries", 0)),
                "source": "shim deadline misses + inferences rebuilt after a loss"}
        cell["deadline_misses"] = int(rc.get("deadline_misses", shim.get("deadline_misses", 0)))


def check(doc: dict[str, Any]) -> list[str]:
    """What every run must show; each failure as a sentence."""
    out = []
    for c in doc["cells"]:
        where = f"{c['balancer']} × {c['profile']}"
        if c.get("app_errors"):
            out.append(f"{where}: {c['app_errors']} app errors")
        if c.get("wrong_results"):
            out.append(f"{where}: {c['wrong_results']} frames differ from local")
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _v(x: Any, suffix: str = "") -> str:
    return "-" if x is None else f"{x}{suffix}"


def _counted(v: dict[str, Any]) -> str:
    return f"{v['value']}" + ("" if v["source"] == "robot daemons" else " ˢ")


def render_row(c: dict[str, Any], hosts: list[str]) -> str:
    lat = c.get("latency") or {}
    place = c.get("placements") or {}
    total = sum(place.values()) + c.get("unplaced", 0)
    share = " / ".join(f"{100 * place.get(h, 0) / total:.0f}" for h in hosts) if total else "-"
    if c.get("unplaced"):
        share += f" (+{100 * c['unplaced'] / total:.0f} unplaced)"
    faults = c.get("faults") or []
    kinds = f"{sum(f['kind'] == 'kill' for f in faults)}k {sum(f['kind'] == 'stop' for f in faults)}s"
    replay = c.get("replayed_share")
    return (f"| {c['balancer']} | {c['profile']} | {_v(lat.get('offered_per_s'))} | "
            f"{_v(lat.get('per_s'))} | {_v(lat.get('p50_ms'))} | {_v(lat.get('p99_ms'))} | "
            f"{_v(lat.get('model_call_p50_ms'))} | {share} | {kinds if faults else '-'} | "
            f"{_counted(c['failovers']) if 'failovers' in c else '-'} | "
            f"{_counted(c['local_fallbacks']) if 'local_fallbacks' in c else '-'} | "
            f"{_v(c.get('deadline_misses'))} | {_v(c.get('app_errors'))} | "
            f"{_v(c.get('wrong_results'))} | "
            f"{'-' if replay is None else f'{100 * replay:.1f}%'} |"
            + (" FAILED |" if c.get("failed") else " |"))


def render(doc: dict[str, Any]) -> str:
    p = doc["plan"]
    hosts = [h["name"] for h in doc["hosts"]]
    links = {m["host"]: m for m in doc["links"]}
    mt = doc["model_time"]
    git = doc["git"]
    lines = [
        f"# Fleet: {p['robots']} robots × {len(hosts)} GPU hosts"
        + (", with chaos" if p["chaos"] else ""), "",
        f"`{doc['command']}`", "",
        f"{doc['started']}, {doc['duration_s']} s; {doc['machine']['cpu_count']} CPUs, "
        f"{doc['machine']['memory_total'] / 2**30:.0f} GiB, {doc['machine']['platform']}; "
        f"commit {(git['commit'] or '?')[:10]}"
        + (" (uncommitted changes)" if git["changed"] else "") + ".", "",
        f"App `{p['app']}` (tests/apps, unmodified, under `rrto-run`, `fallback: local`), one "
        f"per robot, {p['warmup']} warm-up inferences, then {p['duration_s']:g} s of open-loop "
        f"requests per profile; every process `OMP_NUM_THREADS=1`. Host CPU quotas: "
        f"{doc['cgroups']}." + (f" Robot config: `{p['robot_config']}`." if p["robot_config"]
                                else "")
        + (f" Deadline {p['deadline_ms']} ms." if p["deadline_ms"] else ""), "",
        "## Hosts, measured", "",
        "| host | CPU quota (CFS period) | link | RTT ms (target) | up / down Mbit/s (target) "
        "| model ms p50 / p90 in its group (× unthrottled) | host CPU ms per replayed inference |",
        "|---|---|---|---|---|---|---|",
    ]
    for h in doc["hosts"]:
        m = links.get(h["name"], {})
        t = mt.get(h["name"], {})
        quota = (f"{h['cpus']:g} CPU ({h['cfs_period_us'] / 1000:g} ms)" if h["cpus"]
                 else "none")
        lines.append(
            f"| {h['name']} | {quota} | {h['link']} | {_v(m.get('rtt_ms'))} "
            f"({_v(m.get('target_rtt_ms'))}) | {_v(_r1(m.get('up_mbps')))} / "
            f"{_v(_r1(m.get('down_mbps')))} ({_v(_r1(m.get('target_up_mbps')))}) | "
            f"{_v(t.get('p50_ms'))} / {_v(t.get('p90_ms'))} (× {_v(t.get('slowdown'))}) | "
            f"{_v(h.get('cpu_ms_per_replay_median'))} |")
    ref = mt.get("unthrottled", {})
    lines += ["", f"Model alone, unthrottled: p50 {_v(ref.get('p50_ms'))} ms, p90 "
                  f"{_v(ref.get('p90_ms'))} ms. Host CPU per replayed inference: the GPU "
                  "daemon's CPU time over the replays it ran, median over the cells.", "",
              "## Profiles (per robot)", "", "| profile | requests |", "|---|---|"]
    lines += [f"| {name} | {v['per_robot']} |" for name, v in doc["profiles"].items()]
    lines += ["", "## Results", "",
              "Latency: from each request's arrival to the app's last output read (queueing in "
              "the app included), all robots pooled; `model call`: the app's model call alone, "
              "p50. Share: inferences per host, " + " / ".join(hosts) + " (%; unplaced: no host "
              "was seen serving them: run in the app after a loss, or counted by a session "
              "that closed between two polls). ˢ: counted by "
              "the shim (failovers: reconnects to another host; local fallbacks: deadline "
              "misses + inferences rebuilt in the app after a host loss), where the robot "
              "daemons do not report the figure. Faults: kills (k) and stops (s).", "",
              "| balancer | profile | offered/s | done/s | p50 ms | p99 ms | model call ms | "
              "share % | faults | failovers | local fallbacks | deadline misses | errors | "
              "wrong | replayed | |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [render_row(c, hosts) for c in doc["cells"]]
    if doc.get("balancers_skipped"):
        lines += ["", "Not run: " + ", ".join(f"`{b}` ({why})" for b, why in
                                              doc["balancers_skipped"].items()) + "."]
    lines += ["", "## Problems", ""] + ([f"- {x}" for x in doc["problems"]] or ["- none"])
    return "\n".join(lines) + "\n"


def _r1(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


# ---------------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="uniform and spike, 5 s each, 5 warm-up inferences, short calibration")
    p.add_argument("--balancers", type=_names, default=list(BALANCERS))
    p.add_argument("--profiles", type=_names, default=None, help=f"of {', '.join(PROFILES)}")
    p.add_argument("--app", default="resnet", help="a test app of tests/apps")
    p.add_argument("--robots", type=int, default=4)
    p.add_argument("--host-cpus", type=_floats, default=list(HOST_CPUS),
                   help="CPU quota of each GPU host (one host each)")
    p.add_argument("--links", type=_names, default=list(HOST_LINKS),
                   help=f"each host's link, of {', '.join(FLEET_LINKS)}")
    p.add_argument("--duration-s", type=float, default=None, help="per profile (default 30)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiplies every rate")
    p.add_argument("--warmup", type=int, default=None, help="inferences before the schedule")
    p.add_argument("--seed", default="1")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="the apps' intercept.deadline_ms (RRTO_DEADLINE_MS)")
    p.add_argument("--chaos", action="store_true", help="fault GPU daemons during each cell")
    p.add_argument("--chaos-faults", type=_names, default=["kill", "stop"])
    p.add_argument("--chaos-interval-s", type=float, default=4.0,
                   help="mean seconds between faults")
    p.add_argument("--stall-s", type=float, default=2.0, help="seconds a stopped host stays so")
    p.add_argument("--robot-config", action="append", default=[], metavar="KEY=VALUE",
                   help="merged into each robot daemon's config (repeatable; dotted keys)")
    p.add_argument("--no-cgroups", action="store_true", help="hosts unthrottled")
    p.add_argument("--calibrate-runs", type=int, default=None,
                   help="inferences per host for the model-time measurement")
    p.add_argument("--timeout-s", type=float, default=240.0,
                   help="for the apps' warm-up, and past a schedule's end")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    a.profiles = a.profiles or (["uniform", "spike"] if a.quick else list(PROFILE_ORDER))
    a.duration_s = a.duration_s or (5.0 if a.quick else 30.0)
    a.warmup = a.warmup if a.warmup is not None else (5 if a.quick else 8)
    a.calibrate_runs = a.calibrate_runs or (20 if a.quick else 50)
    if unknown := [x for x in a.profiles if x not in PROFILES]:
        p.error(f"unknown profile(s) {unknown}; known: {', '.join(PROFILES)}")
    if len(a.links) != len(a.host_cpus):
        p.error("--links needs one link per host of --host-cpus")
    if unknown := [x for x in a.links if x not in FLEET_LINKS]:
        p.error(f"unknown link(s) {unknown}; known: {', '.join(FLEET_LINKS)}")
    if any(c <= 0 for c in a.host_cpus) or a.robots < 1 or a.warmup < 1:
        p.error("need --host-cpus > 0, --robots >= 1, --warmup >= 1")
    if unknown := [x for x in a.chaos_faults if x not in ("kill", "stop")]:
        p.error(f"unknown fault(s) {unknown}: kill, stop")
    if not (APPS / f"{a.app}.py").exists():
        p.error(f"unknown app {a.app!r} (tests/apps)")
    try:
        a.overrides = parse_overrides(a.robot_config)
    except ValueError as exc:
        p.error(str(exc))
    a.command = "python -m bench.fleet " + shlex.join(argv)
    for k, v in PROCESS_ENV.items():
        os.environ.setdefault(k, v)
    doc = Fleet(a).run()
    md = render(doc)
    a.out.mkdir(parents=True, exist_ok=True)
    name = "fleet-chaos" if a.chaos else "fleet"
    (a.out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (a.out / f"{name}.md").write_text(md)
    print(md)
    return 1 if doc["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
