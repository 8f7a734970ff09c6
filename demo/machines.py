"""Robots and a GPU host emulated on one machine with cgroups (v1 ``cpu`` controller).

A robot's board (a Jetson-class module) computes several times slower than the GPU host it
offloads to, and the host is a machine of its own. On one shared machine the demo gets both:

- each robot (an app, and the robot daemon of the robot that offloads) runs in a group whose CFS
  quota is a fraction of one CPU. Two identical robots run side by side, one computing locally,
  one offloading. A robot keeps the machine's CPUs (no cpuset of its own): torch then splits its
  work over as many threads on the robot as on the host, and since a CPU's rounding depends on
  how the work is split, that is what keeps offloaded outputs bit-identical to local ones. (A
  robot pinned to one CPU would need a host computing with one thread too, half its speed.)
- the GPU host (the GPU daemon and the link emulator) runs in a group with a large CPU weight
  (``cpu.shares``), standing in for a machine nobody else uses: on a busy machine it still gets
  the CPU, as a real host would.

The robots' groups get the same weight, so that they reliably get their quota. The quota is not
the slowdown: CFS lets short bursts through unthrottled, and other work competes for the CPU. So
``Machines.calibrate`` measures the slowdown actually obtained, with the same CPU-bound work
timed in each group.

Needs root and cgroup v1 (``/sys/fs/cgroup/cpu``); ``unavailable()`` says why not otherwise.
Closing (also on exceptions and Ctrl-C, through ``with``) moves every process still inside
back to the root group before removing the groups: a cgroup with members cannot be removed and
would be left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
SHARES = 8192  # 8x a process of the root group's weight

# Pure-Python CPU work, started on a line from stdin so that the process is in its group before
# the clock starts. "spin S": spin S seconds, print the iterations; "count N": print the seconds
# N iterations took.
_WORK = """
import sys, time
mode, arg = sys.stdin.readline().split()
limit = float(arg)
t0 = time.perf_counter(); n = 0; t = 0.0
while (n if mode == "count" else t) < limit:  # the same work per iteration in both modes
    n += 1
    t = time.perf_counter() - t0
print(n if mode == "spin" else t, flush=True)
"""


def unavailable(root: Path = CGROUP) -> str | None:
    """None when this process can make CPU cgroups here, else the reason."""
    if os.geteuid() != 0:
        return "not running as root"
    if not (root / "cpu" / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {root / 'cpu'}"
    return None


class Group:
    """One emulated machine: a ``cpu`` group with a quota and/or a weight. ``join(pid)`` moves a
    process into it, with its future threads and children."""

    def __init__(self, root: Path, name: str, quota: float | None = None, shares: int | None = None,
                 period_us: int = PERIOD_US):
        """``quota`` in CPUs per ``period_us`` (the kernel accepts 1 ms to 1 s; the quota itself
        is at least 1 ms): a short period throttles each burst, a long one only sustained load."""
        self.path = root / "cpu" / name
        self.path.mkdir()
        try:
            if shares is not None:
                (self.path / "cpu.shares").write_text(str(shares))
            if quota is not None:
                (self.path / "cpu.cfs_period_us").write_text(str(period_us))
                (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, round(quota * period_us))))
        except BaseException:
            self.close()
            raise

    def join(self, pid: int) -> None:
        if pid == os.getpid():
            raise ValueError("the demo process itself must stay outside the emulated machines")
        (self.path / "cgroup.procs").write_text(str(pid))

    def members(self) -> list[int]:
        procs = self.path / "cgroup.procs"
        return sorted(int(p) for p in procs.read_text().split()) if procs.exists() else []

    def close(self) -> None:
        """Move every member back to the root group, then remove the group."""
        home = self.path.parent / "cgroup.procs"
        for _ in range(10):  # a member may fork while we move them: repeat until empty
            pids = self.members()
            if not pids:
                break
            for pid in pids:
                try:
                    home.write_text(str(pid))
                except ProcessLookupError:
                    pass  # exited meanwhile
        for _ in range(50):  # the kernel may still be tearing down exited members
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        print(f"warning: could not remove cgroup {self.path}", file=sys.stderr)


class Machines:
    """The robots' and the GPU host's groups; a context manager that always removes them."""

    def __init__(self, robot_cpu: float, root: Path = CGROUP):
        if not 0 < robot_cpu <= 1:
            raise ValueError(f"a robot's CPU share must be in (0, 1], got {robot_cpu}")
        self.robot_cpu = robot_cpu
        self.root = root
        self.groups: list[Group] = []

    def __enter__(self) -> Machines:
        tag = os.getpid()
        try:
            self.robots = [self._add(Group(self.root, f"rrto-demo-robot{i}-{tag}",
                                           quota=self.robot_cpu, shares=SHARES))
                           for i in (1, 2)]
            self.host = self._add(Group(self.root, f"rrto-demo-host-{tag}", shares=SHARES))
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, group: Group) -> Group:
        self.groups.append(group)
        return group

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for group in reversed(self.groups):
            group.close()
        self.groups.clear()

    def describe(self) -> str:
        return f"a cgroup each, with a CPU quota of {self.robot_cpu:g} CPU"

    def calibrate(self, seconds: float = 0.3) -> float:
        """Measured slowdown of CPU-bound work on a robot against the host, with one worker per
        CPU of this machine (as torch sizes its thread pool on both).

        The host's figure is the best of two runs (a preempted run says nothing about the host's
        speed); the robot runs the same number of iterations once.
        """
        iterations = max(min(_work(f"spin {seconds}", self.host)) for _ in range(2))
        return max(_work(f"count {int(iterations)}", self.robots[0])) / seconds


def _work(command: str, group: Group) -> list[float]:
    """Run ``_WORK`` in one process per CPU inside ``group``; returns each one's answer."""
    procs = [subprocess.Popen([sys.executable, "-S", "-c", _WORK], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(os.cpu_count() or 1)]
    try:
        for proc in procs:
            group.join(proc.pid)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return [float(proc.communicate(timeout=60)[0]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
