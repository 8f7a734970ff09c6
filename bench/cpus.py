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
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


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


def pinned(cmd: list[str], cpus: tuple[int, ...] | None) -> list[str]:
    """``cmd`` run on ``cpus`` only (unchanged when None)."""
    if cpus is None:
        return list(cmd)
    return [sys.executable, __file__, ",".join(map(str, cpus)), "--", *cmd]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m bench.cpus CPU[,CPU...] -- command [args...]", file=sys.stderr)
        return 2
    try:
        cpus = {int(c) for c in argv[0].split(",")}
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as exc:
        print(f"bench.cpus: cannot pin to {argv[0]}: {exc}", file=sys.stderr)
        return 2
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
