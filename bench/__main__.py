"""``python -m bench``: every model × link × system, written to bench/results/.

``--quick`` is the few-minutes subset for this 2-core machine (3 small models, loopback and
wifi6-edge, 10 inferences per cell); the full run covers every model and link.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from bench.cpus import split
from bench.harness import SCHEDULED, SYSTEMS, Plan, run
from bench.inputs import INPUTS
from bench.link import ALL_LINKS, LINKS
from bench.models import MODELS, QUICK_MODELS
from bench.report import update_readme, write

REPO = Path(__file__).resolve().parent.parent

QUICK_LINKS = ("loopback", "wifi6-edge")


def _csv(value: str, allowed: list[str] | tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(unknown)} "
                                         f"(known: {', '.join(allowed)})")
    return items


def _terminate(signum: int, frame: object) -> NoReturn:
    # SIGTERM unwinds like Ctrl-C, so every context manager stops its child processes.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few minutes on this machine")
    parser.add_argument("--models", type=lambda v: _csv(v, list(MODELS), "model"))
    parser.add_argument("--links", type=lambda v: _csv(v, list(ALL_LINKS), "link"),
                        help="default: " + ",".join(LINKS) + "; also a bandwidth sweep: "
                             + ",".join(k for k in ALL_LINKS if k not in LINKS))
    parser.add_argument("--systems", type=lambda v: _csv(v, [*SYSTEMS, *SCHEDULED], "system"),
                        help="default: " + ",".join(SYSTEMS) + "; also rrto under another "
                             "scheduler: " + ",".join(SCHEDULED))
    parser.add_argument("--iters", type=int, help="measured inferences per cell")
    parser.add_argument("--warmup", type=int, help="warm-up inferences per cell (record phase)")
    parser.add_argument("--budget-s", type=float, help="stop measuring a cell after this")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each (link, model)'s remote systems this many times back to "
                             "back, the order reversed every other round; each ratio is then the "
                             "median of the rounds' own (the machine's drift between cells "
                             "minutes apart does not enter it)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every process of the run")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results)")
    parser.add_argument("--split-cpus", action="store_true",
                        help="pin the robot side (apps, robot daemons) and the host side (GPU "
                             "daemon, NTO server) to disjoint halves of the CPUs (bench/cpus.py)")
    parser.add_argument("--robot-cpu", type=float,
                        help="run the robot side (apps, robot daemons) in a cgroup with this many "
                             "CPUs' worth of time (e.g. 0.25; cgroup v1, root): a slower robot")
    parser.add_argument("--preload-weights", action="store_true",
                        help="put each model's weights in the GPU daemon's cache over a direct "
                             "route before a link's cells (a slow link then carries inferences "
                             "only, as NTO's server has its model already)")
    parser.add_argument("--inputs", choices=INPUTS, default="randn",
                        help="each inference's input: normal noise (default), or for image "
                             "models 8-bit camera frames the app normalises before the model")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    signal.signal(signal.SIGTERM, _terminate)
    plan = Plan(
        models=args.models or list(QUICK_MODELS if args.quick else MODELS),
        links=args.links or list(QUICK_LINKS if args.quick else LINKS),
        systems=args.systems or list(SYSTEMS),
        iters=args.iters or (10 if args.quick else 30),
        warmup=args.warmup if args.warmup is not None else (3 if args.quick else 5),
        budget_s=args.budget_s or (15.0 if args.quick else 60.0),
        cell_timeout_s=120.0 if args.quick else 300.0,
        quick=args.quick,
        rounds=args.rounds,
        threads=args.threads,
        robot_cpu=args.robot_cpu,
        preload=args.preload_weights,
        inputs=args.inputs,
    )
    if args.split_cpus:
        try:
            plan.cpus = split()
        except ValueError as exc:
            parser.error(str(exc))
    if args.out:
        plan.out_dir = args.out
    print(f"bench: models {','.join(plan.models)}; links {','.join(plan.links)}; "
          f"systems {','.join(plan.systems)}; {plan.iters} iterations after {plan.warmup} warm-up"
          + (f"; {plan.rounds} rounds" if plan.rounds > 1 else ""))
    try:
        doc = run(plan)
    except OSError as exc:
        parser.error(f"--robot-cpu: cannot make the robot's cgroup: {exc}")
    except KeyboardInterrupt:
        print("bench: interrupted; child processes stopped, nothing written", file=sys.stderr)
        return 130
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + ("-quick" if plan.quick else "")
    paths = write(doc, plan.out_dir, stamp)
    full = (not plan.quick and args.out is None and plan.models == list(MODELS)
            and plan.links == list(LINKS) and plan.systems == list(SYSTEMS))
    if full and update_readme(REPO / "README.md", doc):  # the README shows the latest full run
        paths["readme"] = REPO / "README.md"
    for kind, path in paths.items():
        print(f"bench: wrote {kind} {path}")
    ok = sum(c["status"] == "ok" for c in doc["cells"])
    print(f"bench: {ok}/{len(doc['cells'])} cells reported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
