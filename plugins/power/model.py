"""``model``: an estimate for robots with no power sensor, from what the robot is doing.

The RRTO paper measured its robot in three states and reports a constant power for each:
running inference 13.35 W, communicating 4.25 W, standing by 4.04 W. This meter integrates the
configured watts (``power.model``) of the machine's current state over time. The state comes
from the energy accountant, which derives it from what the sessions are doing (the highest-ranked
state any open session is in: inference > communication > standby).

CPU refinement: the state says what a session is *for*, not how hard the robot works meanwhile.
Local compute in an app process (pre-processing, a local fallback, the robot's share of a split
placement) draws power like inference does. So CPU time used by the tracked app processes,
as a fraction of the machine's cores, moves the power from the state's figure toward the
inference figure: ``P = W[state] + max(0, W[inference] - W[state]) * busy``. Only processes the
daemon tracks count (``track(pid)``), not the whole machine, because in the single-machine setup
the GPU-role executor runs on the same CPU and its work is the host's, not the robot's. Tracking
nothing gives the plain state model.

``busy`` is relative to the CPUs the robot has: those the daemon may run on, limited by its
cgroup's CPU quota (``usable_cpus``). A robot daemon in a container limited to one CPU, or the
demo's emulated robot (a quarter of a CPU), is fully busy when that share is used up.

Always available: ``probe()`` returns None.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from rrto_plugins.power.base import STATES, MeterBase

DEFAULT_WATTS: dict[str, float] = {"inference": 13.35, "communication": 4.25, "standby": 4.04}


def check_watts(watts: Mapping[str, float] | None) -> dict[str, float]:
    """The state -> watts table, complete and non-negative, or ValueError naming the key."""
    table = dict(DEFAULT_WATTS if watts is None else watts)
    unknown = sorted(set(table) - set(STATES))
    if unknown:
        raise ValueError(f"power.model: unknown state(s) {', '.join(unknown)} "
                         f"(expected {', '.join(STATES)})")
    missing = [s for s in STATES if s not in table]
    if missing:
        raise ValueError(f"power.model: missing watts for {', '.join(missing)}")
    for state, value in table.items():
        if not value >= 0:
            raise ValueError(f"power.model.{state}: expected watts >= 0, got {value!r}")
    return {s: float(table[s]) for s in STATES}


def usable_cpus(pid: int | str = "self") -> float:
    """The CPUs process ``pid`` may use: its affinity mask, capped by its cgroup's CPU quota."""
    try:
        cpus: float = len(os.sched_getaffinity(0 if pid == "self" else int(pid)))
    except (AttributeError, OSError):
        cpus = psutil.cpu_count() or 1
    try:
        membership = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return cpus
    return min(cpus, cgroup_cpu_limit(membership))


def cgroup_cpu_limit(membership: str, root: Path = Path("/sys/fs/cgroup")) -> float:
    """The smallest CPU quota (in CPUs) on the path from a process's cgroup up to the root, for
    ``membership`` as in ``/proc/PID/cgroup``; inf without one. cgroup v1 (``cpu.cfs_quota_us``
    / ``cpu.cfs_period_us`` under the ``cpu`` controller's mount) and v2 (``cpu.max``)."""
    limit = float("inf")
    for line in membership.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2, mounted at the root or, in hybrid mode, at root/unified
            base = root / "unified" if (root / "unified").is_dir() else root
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
        else:
            continue
        group = base / path.strip("/")
        for directory in [group, *group.parents]:
            limit = min(limit, _quota(directory))
            if directory == base:
                break
    return limit


def _quota(group: Path) -> float:
    """CPUs allowed by this one group's quota (inf: no quota, or no such files)."""
    try:
        if (group / "cpu.max").exists():
            quota, _, period = (group / "cpu.max").read_text().partition(" ")
        else:
            quota = (group / "cpu.cfs_quota_us").read_text()
            period = (group / "cpu.cfs_period_us").read_text()
        if quota.strip() in ("max", "-1"):
            return float("inf")
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return float("inf")


class ProcessCpu:
    """Busy fraction of the machine's cores spent in the tracked processes since the last call.

    The robot daemon calls this at every state change of a session, i.e. a few times per relayed
    inference, on its event loop. On Linux each tracked process's ``/proc/PID/stat`` stays open
    and is re-read with one ``pread`` (~1 us; psutil opens and parses it anew, ~20 us). The open
    file also pins the process: once it has exited, reads fail instead of reading a new process
    that reused the pid.

    ``cores``: the robot's CPUs; by default ``usable_cpus()`` of the daemon, looked up again
    whenever a process starts being tracked (cheap, and a daemon moved into a cgroup after it
    started is then measured against its new quota).
    """

    _TICK = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns, cores: float | None = None):
        self._clock = clock
        self._fixed_cores = cores
        self._cores = cores or usable_cpus()
        self._procs: dict[int, int | psutil.Process] = {}  # an open /proc/PID/stat, or psutil's
        self._refs: Counter[int] = Counter()
        self._last_cpu: dict[int, float] = {}
        self._last_t = clock()

    def count_against(self, cores: float) -> None:
        """From now on, busy is relative to ``cores`` CPUs, whatever this process may use."""
        self._fixed_cores = self._cores = cores

    @classmethod
    def _seconds(cls, proc: int | psutil.Process) -> float:
        if isinstance(proc, int):
            # utime and stime are fields 14 and 15; the command name before them may hold spaces.
            fields = os.pread(proc, 4096, 0).rpartition(b")")[2].split()
            return (int(fields[11]) + int(fields[12])) * cls._TICK
        times = proc.cpu_times()
        return float(times.user + times.system)

    @staticmethod
    def _open(pid: int) -> int | psutil.Process:
        try:
            return os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if os.path.isdir("/proc/self"):
                raise psutil.NoSuchProcess(pid) from None
            return psutil.Process(pid)  # no procfs: psutil knows how to ask this system
        except OSError:
            return psutil.Process(pid)

    @staticmethod
    def _close(proc: int | psutil.Process | None) -> None:
        if isinstance(proc, int):
            os.close(proc)

    def add(self, pid: int) -> None:
        if self._fixed_cores is None:
            self._cores = usable_cpus()
        if self._refs[pid] == 0:
            proc = None
            try:
                proc = self._open(pid)
                self._last_cpu[pid] = self._seconds(proc)
            except (psutil.Error, OSError, ValueError, IndexError):
                self._close(proc)
                return  # already gone (or not ours to see): nothing to count
            self._procs[pid] = proc
        self._refs[pid] += 1

    def remove(self, pid: int) -> None:
        if self._refs[pid] <= 1:
            self._refs.pop(pid, None)
            self._close(self._procs.pop(pid, None))
            self._last_cpu.pop(pid, None)
        else:
            self._refs[pid] -= 1

    def __call__(self) -> float:
        now = self._clock()
        elapsed = (now - self._last_t) / 1e9
        self._last_t = now
        busy = 0.0
        for pid, proc in list(self._procs.items()):
            try:
                seconds = self._seconds(proc)
            except (psutil.Error, OSError, ValueError, IndexError):
                self._close(self._procs.pop(pid, None))  # exited: its last slice is lost (small)
                continue
            busy += max(0.0, seconds - self._last_cpu[pid])
            self._last_cpu[pid] = seconds
        if elapsed <= 0:
            return 0.0
        return min(1.0, busy / (elapsed * self._cores))

    def __del__(self) -> None:
        for proc in getattr(self, "_procs", {}).values():
            try:
                self._close(proc)
            except OSError:
                pass


class ModelMeter(MeterBase):
    """Integrated model power, in joules since construction.

    ``clock`` (ns) and ``cpu`` (a callable returning the busy fraction since its last call) are
    injectable for tests; by default ``cpu`` is a ``ProcessCpu`` fed by ``track``/``untrack``,
    counting against ``cores`` CPUs (default: the CPUs this process may use).
    """

    blocking = False
    follows_state = True  # its power is the state's (set_state), refined by tracked CPU use

    def __init__(
        self,
        watts: Mapping[str, float] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        cpu: Callable[[], float] | None = None,
        cores: float | None = None,
    ):
        self.watts = check_watts(watts)
        self._clock = clock
        self._procs = ProcessCpu(clock, cores) if cpu is None else None
        self._cpu: Callable[[], float] = cpu if cpu is not None else self._procs  # type: ignore[assignment]
        self.state = "standby"
        self._last_t = self.read_ns = clock()
        self._joules = 0.0

    @staticmethod
    def probe() -> str | None:
        return None

    def count_against(self, cores: float) -> None:
        """Measure busy against ``cores`` CPUs (the robot's), not those of this process: for
        a meter that runs outside the robot (the benchmark's, around an app in the robot's
        cgroup, whose quota is a quarter of a CPU while the harness may use two)."""
        if self._procs is not None:
            self._procs.count_against(cores)

    def power_w(self, state: str, busy: float) -> float:
        base = self.watts[state]
        return base + max(0.0, self.watts["inference"] - base) * min(1.0, max(0.0, busy))

    def _advance(self) -> None:
        now = self._clock()
        busy = self._cpu()
        self._joules += self.power_w(self.state, busy) * max(0, now - self._last_t) / 1e9
        self._last_t = self.read_ns = now  # the moment the figure is for (EnergyAccountant)

    def set_state(self, state: str) -> None:
        """The machine's state changed now: close the interval at the old state's power."""
        if state not in self.watts:
            raise ValueError(f"unknown state {state!r} (expected {', '.join(STATES)})")
        self._advance()
        self.state = state

    def track(self, pid: int) -> None:
        """Count this process's CPU time as robot work (an app process of a session)."""
        if self._procs is not None:
            self._procs.add(pid)

    def untrack(self, pid: int) -> None:
        if self._procs is not None:
            self._procs.remove(pid)

    def read(self) -> float:
        self._advance()
        return self._joules

    def describe(self) -> dict[str, Any]:
        return {"kind": "model", "watts": dict(self.watts), "state": self.state}
