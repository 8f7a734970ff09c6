"""Two machines on one: the robot side and the GPU host side of a run on disjoint CPUs.

On one machine every process of a run shares its CPUs: the app's own Python work (the shim's
matching, the model's Python code) then slows the host's compute, and the NTO server, whose
client is idle, gets every core to itself. A real robot and its GPU host share no CPU. With
``python -m bench --split-cpus`` the harness pins the robot side (the app of every system, the
robot daemons) to the first half of the CPUs it may use and the host side (the GPU daemon, the
NTO server) to the other half, so that each side computes only on its own cores, the same ones
for every system. The link emulator and the harness itself stay unpinned (they are the network
and the observer, not either machine).

Pinning is ``sched_setaffinity`` in a tiny launcher that then ``exec``s the command
(``python bench/cpus.py 0,1 -- cmd ...``): every thread the command starts inherits it, and no
external tool (``taskset``) is needed.

A robot slower than its host: ``--robot-cpu 0.25`` runs the robot side in a cgroup (v1 ``cpu``
controller, as root) with a quota of a quarter of one CPU's time (``robot_group``); the same
launcher writes its own PID into the group before it ``exec``s (``--cgroup PATH``), so the
command and every process it starts are throttled from their first instruction. Short bursts
are throttled less than long runs: the benchmark reports the slowdown it measured (the local
run's latency over the host's own compute of the same model), never the quota.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
# The quota's period. With the default 100 ms, an inference needing just over one period's
# quota waited for the next: unet at 0.25 CPU ran in 105 or 185 ms (3 of 20 slow locally, 7 of
# 20 with the robot daemon beside it), and a median of three could land on either. 10 ms
# throttles in finer steps, as a slower CPU would: no second mode (142 ms median, p90 160).
PERIOD_US = 10_000


@dataclass(frozen=True)
class Split:
    robot: tuple[int, ...]
    host: tuple[int, ...]

    def to_dict(self) -> dict[str, list[int]]:
        return {"robot": list(self.robot), "host": list(self.host)}


def split(available: set[int] | None = None) -> Split:
    """The robot side gets the first half of the CPUs this process may use, the host the rest.
    Raises ValueError with fewer than two (nothing to split)."""
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"--split-cpus needs at least 2 CPUs, this process may use {len(cpus)}")
    half = len(cpus) // 2
    return Split(tuple(cpus[:half]), tuple(cpus[half:]))


def pinned(cmd: list[str], cpus: tuple[int, ...] | None, cgroup: str | None = None) -> list[str]:
    """``cmd`` run on ``cpus`` only and in ``cgroup`` (unchanged when both are None)."""
    if cpus is None and cgroup is None:
        return list(cmd)
    where = ",".join(map(str, cpus)) if cpus is not None else "all"
    return [sys.executable, __file__, where, *(("--cgroup", cgroup) if cgroup else ()), "--",
            *cmd]


@contextlib.contextmanager
def robot_group(cpus: float, root: Path = CGROUP_CPU) -> Iterator[str]:
    """A cgroup with ``cpus`` CPUs' worth of time per period, removed afterwards (its
    processes, all ended by then, are moved back to the root group first if any remain).
    OSError if the cgroup v1 ``cpu`` controller is not there or not writable (not root)."""
    path = root / f"rrto-bench-robot-{os.getpid()}"
    path.mkdir()
    try:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(max(1000, round(cpus * PERIOD_US))))
        yield str(path)
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def main(argv: list[str]) -> int:
    usage = "usage: python -m bench.cpus CPU[,CPU...]|all [--cgroup PATH] -- command [args...]"
    cgroup = None
    if len(argv) > 2 and argv[1] == "--cgroup":
        cgroup, argv = argv[2], [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--":
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] != "all":
            os.sched_setaffinity(0, {int(c) for c in argv[0].split(",")})
        if cgroup is not None:  # this process, then the command it becomes (same PID)
            Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    except (ValueError, OSError) as exc:
        print(f"bench.cpus: cannot pin to {argv[0]} / join {cgroup}: {exc}", file=sys.stderr)
        return 2
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
