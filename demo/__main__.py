"""``make demo``: an unmodified camera app on an emulated robot, computing locally, and the same
app on an identical robot offloading through a robot daemon and a GPU daemon over an emulated
Wi-Fi 6 link; then a table of what offloading changed for the robot.

- The robots: as root, each robot's processes (the app; the robot daemon too on the offloading
  one) run in a cgroup with a quarter of one CPU, side by side, and the GPU daemon and the link
  emulator in a cgroup weighted as a machine of its own (``demo/machines.py``); the demo
  measures the slowdown this gave against the host. Without root (or without cgroup v1) the
  robot is this machine itself, the two runs take turns, and the demo says so.
- The app: ``examples/camera_loop.py``, a YOLOv8n-sized detector on 640x480 frames.
- The link: the benchmark's ``wifi6-edge`` emulator (``bench/link.py``); the demo prints the RTT
  and throughput it measured through it.
- Robot energy per frame: the ``model`` power meter (the RRTO paper's robot), the same meter
  class and watts for both runs: the robot daemon's meter for the offloaded run (read from its
  status while the app runs), and the same meter run by the demo for the local run, which no
  daemon sees. The energy of the steady-state window of frames, divided by its frames.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demo.machines import Group, Machines, unavailable
from rrto_plugins.power.model import DEFAULT_WATTS, ModelMeter, usable_cpus
from rrtod.ctl import request
from testkit.apps import shim_stats
from testkit.daemons import Launcher, free_port

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "examples" / "camera_loop.py"
BIN = Path(sys.executable).parent
LINK = "wifi6-edge"
SAMPLE_HZ = 10.0  # the daemon's default power.sample_hz, for both runs


class EnergySeries:
    """The robot's cumulative energy (joules) over time (CLOCK_MONOTONIC ns, the clock of the
    app's frame times), so the energy of any window of frames can be read off it."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []

    def add(self, t_ns: int, joules: float) -> None:
        self.points.append((t_ns, joules))

    def at(self, t_ns: int) -> float:
        i = bisect.bisect_left(self.points, t_ns, key=lambda p: p[0])
        if i == 0:
            return self.points[0][1]
        if i == len(self.points):
            return self.points[-1][1]
        (t0, e0), (t1, e1) = self.points[i - 1], self.points[i]
        return e0 + (e1 - e0) * (t_ns - t0) / (t1 - t0)

    def per_frame(self, spans_ns: list[list[int]]) -> float | None:
        """Energy from the first frame's start to the last one's end, per frame."""
        if len(self.points) < 2 or not spans_ns:
            return None
        return (self.at(spans_ns[-1][1]) - self.at(spans_ns[0][0])) / len(spans_ns)


class LocalEnergy:
    """The robot daemon's power meter, run here for the local run (no daemon sees that app):
    the ``model`` meter tracking the app's CPU time against the robot's CPUs, sampled at the
    daemon's rate."""

    def __init__(self, cores: float):
        self.meter = ModelMeter(DEFAULT_WATTS, cores=cores)
        self.series = EnergySeries()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def watch(self, pid: int) -> None:
        self.meter.track(pid)
        self._thread.start()

    def _sample(self) -> None:
        while True:
            self.series.add(time.monotonic_ns(), self.meter.read())
            if self._stop.wait(1.0 / SAMPLE_HZ):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class AppRun:
    """One run of the app on a robot, started at once; ``result()`` waits for its JSON line."""

    def __init__(self, frames: int, robot: Group | None, save: Path, env: dict[str, str] | None = None,
                 offload: bool = False, energy: LocalEnergy | None = None):
        cmd = [sys.executable, str(APP), "--frames", str(frames), "--save", str(save)]
        if offload:
            cmd = [str(BIN / "rrto-run"), *cmd]
        self.energy = energy
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, text=True,
                                     env={**os.environ, **(env or {})}, cwd=REPO)
        try:
            if robot is not None:
                robot.join(self.proc.pid)  # before torch starts its threads: they follow it
            if energy is not None:
                energy.watch(self.proc.pid)
        except BaseException:
            self.close()
            raise

    def result(self, timeout: float = 600) -> dict[str, Any]:
        try:
            self.proc.wait(timeout)
        finally:
            self.close()
        self.out.seek(0)
        self.err.seek(0)
        stdout, stderr = self.out.read(), self.err.read()
        if self.proc.returncode != 0:
            raise RuntimeError(f"app failed ({self.proc.returncode}):\n{stderr}")
        result = json.loads(stdout.strip().splitlines()[-1])
        result["stderr"] = stderr
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.energy is not None:
            self.energy.stop()


def replays(session: dict[str, Any] | None) -> int:
    record = (session or {}).get("record") or {}
    return sum(int(s.get("replays") or 0) for s in record.get("sequences") or [])


class DaemonWatch:
    """Polls the robot daemon while the offloaded app runs: the robot's energy (its power
    meter's total) over time, and the session's counters at the first poll after replay began
    (the steady state is from there on)."""

    def __init__(self, socket: str):
        self.socket = socket
        self.energy = EnergySeries()
        self.snapshot: dict[str, Any] = {}

    def __call__(self, proc: subprocess.Popen[str]) -> None:
        while proc.poll() is None:
            t = time.monotonic_ns()
            status = request(self.socket, "status")
            if status.get("power"):  # None when the daemon has no power meter (its log says why)
                self.energy.add(t, status["power"]["total_j"])
            session = next((s for s in status["sessions"] if s["pid"] == proc.pid), None)
            if session and replays(session) and not self.snapshot:
                self.snapshot = session
            time.sleep(1.0 / SAMPLE_HZ)


def compare(local: dict[str, Any], offloaded: dict[str, Any], saved: Path) -> tuple[int, int]:
    """Frames whose outputs are bit-identical, and frames whose outputs are equal within 1e-4:
    a CUDA host rounds differently from the robot's CPU (on this machine's CPU they match)."""
    same = sum(a == b for a, b in zip(local["digests"], offloaded["digests"], strict=True))
    if same == len(local["digests"]):
        return same, same
    import torch  # only here: importing it takes seconds

    a, b = torch.load(saved / "local.pt"), torch.load(saved / "offloaded.pt")
    close = sum(all(torch.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(fa, fb, strict=True))
                for fa, fb in zip(a, b, strict=True))
    return same, close


def summary(run: dict[str, Any], first: int) -> dict[str, float]:
    """Latency and frame rate over frames ``first``.. (the steady state)."""
    lat = sorted(run["latency_ms"][first:])
    starts = [s for s, _ in run["spans_ns"][first:]]
    fps = (len(starts) - 1) / ((starts[-1] - starts[0]) / 1e9) if len(starts) > 1 else float("nan")
    return {"median": statistics.median(lat), "p90": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
            "fps": fps, "cpu": statistics.median(run["cpu_ms"][first:])}


def _joules(v: float | None) -> str:
    return f"{v:.2f} J" if v is not None else "n/a"


def _size(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


@dataclass
class Results:
    local: dict[str, Any]
    offloaded: dict[str, Any]
    status: dict[str, Any]  # the robot daemon's, after the offloaded session ended
    watch: DaemonWatch
    energy: LocalEnergy
    same: int  # frames with bit-identical outputs
    close: int  # frames with outputs equal within 1e-4


def report(frames: int, r: Results, link: str, measured: Any, device: str) -> int:
    """Print what offloading changed, over the steady state; 0 when every frame's outputs match."""
    shim = shim_stats(r.offloaded["stderr"]) or {}
    replayed = int(shim.get("replays", 0))
    first = min(frames - 2, max(1, frames - replayed))  # frames before replay began
    lo, off = summary(r.local, first), summary(r.offloaded, first)
    # Robot energy per frame: the meter's energy from the first steady frame's start to the
    # last frame's end, over the frames (grabbing the next frame included, as on a robot).
    local_j = r.energy.series.per_frame(r.local["spans_ns"][first:])
    off_j = r.watch.energy.per_frame(r.offloaded["spans_ns"][first:])
    # Bytes per frame: from the first poll after replay began to the end, per replay (a
    # replay's upload and its count go together).
    n_replays = max(1, replayed - replays(r.watch.snapshot))
    per_frame = {k: (r.status["finished"][k] - r.watch.snapshot.get(k, 0)) / n_replays
                 for k in ("bytes_up", "bytes_down")}

    print(f"GPU host: the GPU daemon on this machine computes on device '{device}'"
          + (" (no CUDA device here: the host's CPUs stand in for a GPU)" if device == "cpu" else ""))
    print(f"link: {link} (emulated), measured RTT {measured.rtt_ms:.2f} ms, "
          f"throughput up {measured.up_mbps:.0f} / down {measured.down_mbps:.0f} Mbit/s"
          + ("" if measured.valid else f" (OFF TARGET: {'; '.join(measured.problems)})"))
    w = DEFAULT_WATTS
    print(f"robot energy: power meter 'model', modelled (RRTO paper's robot: inference "
          f"{w['inference']} W, communication {w['communication']} W, standby {w['standby']} W; "
          f"app CPU use moves it toward inference)")
    print()
    rows = [
        ("", "local (on the robot)", "offloaded"),
        ("frame latency, median / p90", f"{lo['median']:.0f} / {lo['p90']:.0f} ms",
         f"{off['median']:.0f} / {off['p90']:.0f} ms"),
        ("frames per second (loop)", f"{lo['fps']:.2f}", f"{off['fps']:.2f}"),
        ("robot energy / frame", _joules(local_j), _joules(off_j)),
        ("app CPU time / frame", f"{lo['cpu']:.0f} ms", f"{off['cpu']:.0f} ms"),
        ("frames replayed, 1 request each", "-", f"{replayed} of {frames}"),
        ("bytes / frame, up / down", "-",
         f"{_size(per_frame['bytes_up'])} / {_size(per_frame['bytes_down'])}"),
        ("frame input + output size", "",
         f"{_size(r.local['input_bytes'])} + {_size(r.local['output_bytes'])}"),
        ("outputs identical to local", "", f"{r.same} of {frames} frames"
         + ("" if r.same == r.close else f" (equal within 1e-4: {r.close})")),
    ]
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(wd) for c, wd in zip(row, width, strict=True)).rstrip())
    print()
    print(f"Steady state: frames {first + 1}-{frames} (the frames before recorded the "
          f"model's operator sequence); energy from the start of frame {first + 1} to the end of "
          f"the last, per frame; bytes over the replays after the demo saw replay begin.")
    return 0 if r.close == frames else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__)
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--robot-cpu", type=float, default=0.25,
                        help="the robot's CPU share (cgroup quota); 0: run on the whole machine")
    args = parser.parse_args(argv)
    started = time.monotonic()
    took: dict[str, float] = {}

    def lap(what: str) -> None:
        took[what] = time.monotonic() - started - sum(took.values())
    # Several processes share this machine's cores: without this, idle torch worker threads of
    # one process spin and steal the core of the one computing (see bench/harness.py).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # A TERM (not only Ctrl-C) unwinds through the with-blocks: the cgroups and the daemons
    # never outlive the demo.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    sys.path.insert(0, str(REPO))  # the emulator is the benchmark's (not installed)
    from bench.link import LINKS, LinkProcess, MeasureServer, measure

    spec = LINKS[LINK]
    print(f"rrtod demo: {APP.relative_to(REPO)} (YOLOv8n-sized detector, 640x480 frames), "
          f"{args.frames} frames computed on a robot, and offloaded from a robot to a GPU daemon")
    with ExitStack() as stack:
        reason = unavailable() if args.robot_cpu > 0 else "--robot-cpu 0"
        machines = None if reason else stack.enter_context(Machines(args.robot_cpu))
        robot, offloader = machines.robots if machines else (None, None)
        if machines is not None:
            slowdown = machines.calibrate()
            lap("calibration")
            print(f"robots: emulated: two identical robots side by side, one computing locally, "
                  f"one offloading (the app, and its robot daemon), in {machines.describe()}; "
                  f"measured {slowdown:.1f}x slower than the GPU host (CPU-bound work, one "
                  f"process per CPU)")
            cores = args.robot_cpu
        else:
            print(f"robot: this whole machine ({reason}: no CPU-quota cgroup, so the robot "
                  f"computes as fast as the GPU host); the local run comes first, then the "
                  f"offloaded one")
            cores = usable_cpus()
        saved = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rrto-demo-")))
        energy = LocalEnergy(cores)
        local_run = stack.enter_context(closing(AppRun(args.frames, robot, saved / "local.pt",
                                                       energy=energy)))
        if machines is None:
            local = local_run.result()
            lap("local run")
        launcher = stack.enter_context(Launcher())
        gpu = launcher.start("gpu", roles=["gpu"], listen=f"127.0.0.1:{free_port()}", wait=False)
        if machines is not None:
            machines.host.join(gpu.proc.pid)
        link = stack.enter_context(LinkProcess(spec, [gpu.listen, (server := MeasureServer()).address]))
        stack.callback(server.close)
        if machines is not None:
            machines.host.join(link.proc.pid)
        gpu.wait_notify("READY=1")
        robot_d = launcher.start("robot", roles=["robot"], listen=f"127.0.0.1:{free_port()}",
                                 hosts=[{"name": "gpu", "address": link.address(0)}],
                                 power={"meter": "model", "sample_hz": SAMPLE_HZ})
        if offloader is not None:
            offloader.join(robot_d.proc.pid)  # once started: a robot's daemon is a long-running service
        robot_d.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="GPU host up")
        measured = measure(link.address(1), spec, link, bulk_s=0.2)
        lap("daemons")
        watch = DaemonWatch(robot_d.socket)
        offloaded_run = stack.enter_context(closing(AppRun(
            args.frames, offloader, saved / "offloaded.pt", env={**robot_d.env, "RRTO_STATS": "1"},
            offload=True)))
        watch(offloaded_run.proc)
        offloaded = offloaded_run.result()
        status = robot_d.wait_for(lambda s: not s["sessions"], what="session end")
        lap("offloaded run")
        if machines is not None:
            local = local_run.result()
            lap("local run (rest)")
        device = request(gpu.socket, "status")["gpu"]["device"]
        robot_d.stop()  # before the link goes, so it does not log a lost host
        same, close = compare(local, offloaded, saved)

    code = report(args.frames, Results(local, offloaded, status, watch, energy, same, close),
                  spec.name, measured, device)
    lap("rest")
    print(f"demo took {time.monotonic() - started:.0f} s ("
          + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()) + ")")
    if same == args.frames:
        print("outputs identical: yes")
    else:
        print("outputs identical: " + ("no, but equal within 1e-4 (the host rounds differently)"
                                       if close == args.frames else "NO"))
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the with-blocks have removed the cgroups and stopped everything
        print("interrupted", file=sys.stderr)
        sys.exit(130)
