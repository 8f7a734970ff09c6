"""The replay plumbing micro-benchmark: what one replayed inference costs between the processes.

    .venv/bin/python -m bench.plumbing [--models mlp,cnn,transformer] [--iters 50] [--warmup 10]

Starts a GPU daemon and a robot daemon on this machine (``testkit.daemons.Launcher``, loopback, no
link emulator), and per model runs the same plain-torch inference loop three ways: locally, under
``rrto-run`` (record, then replay), and as the hand-written NTO client of ``bench/nto.py`` (one
gRPC request per inference to a server owning the model). Every process runs with
``OMP_WAIT_POLICY=PASSIVE``; the shim with ``RRTO_STATS=1``. Reported: median and p90 latency of
the measured (steady-state) inferences, and for rrto the median timeline of one inference through
the hops, from ``RRTO_HOP_TRACE`` timestamps (``rrtod/framing.py``: shim, robot and GPU daemons
record CLOCK_MONOTONIC per hop, one clock for all processes). ``--no-hops`` runs without them.

Hops of a replayed inference, in order: the app calls the model (``app.begin``), the shim sends
the start and its inputs (``shim.send``), the robot daemon reads each frame (``robot.up.read``)
and writes it to the gRPC stream (``robot.up.written``), the GPU daemon reads it
(``gpu.up.read``), its worker runs the sequence (``gpu.work.begin``..``gpu.work.end``) and emits
each output (``gpu.emit``), which the stream yields (``gpu.down.yield``), the robot reads it
(``robot.down.read``) and writes it to the app's socket (``robot.down.written``), the shim's
reader receives it (``shim.recv``) and the app has its outputs (``app.end``).

``python -m bench.plumbing app --model M`` is the app itself: plain torch, nothing of rrtod.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testkit.apps import shim_stats  # stdlib only: fine in the app process

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODELS = ("mlp", "cnn", "transformer")
ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
RRTO_ENV = {"RRTO_MODE": "stream", "RRTO_REPLAY": "1", "RRTO_FALLBACK": "error", "RRTO_STATS": "1"}
HOPS = ("shim.send", "robot.up.read", "robot.up.written", "gpu.up.read", "gpu.work.begin",
        "gpu.exec.begin", "gpu.exec.end", "gpu.emit", "gpu.work.end", "gpu.down.yield",
        "robot.down.read", "robot.down.written", "shim.recv")


# ----- the app (runs under rrto-run: plain torch only) -----
def cpu_ns(pid: int | str) -> int:
    """CPU time of every live thread of ``pid`` (ns, from /proc/PID/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that just ended
    return total


def app(model_name: str, iters: int, warmup: int, pids: dict[str, int]) -> int:
    import torch

    from bench.models import MODELS as SPECS
    from bench.models import outputs_of

    spec = SPECS[model_name]
    model = spec.make()
    inputs = spec.inputs(warmup + iters)
    begin, end = [], []
    pids = {"app": os.getpid(), **pids}
    cpu0: dict[str, int] = {}
    with torch.inference_mode():
        for i, x in enumerate(inputs):
            if i == warmup:  # CPU of each process over the measured inferences (untimed)
                cpu0 = {name: cpu_ns(pid) for name, pid in pids.items()}
            t0 = time.monotonic_ns()
            out = [o.numpy().tobytes() for o in outputs_of(model(x))]
            t1 = time.monotonic_ns()
            begin.append(t0)
            end.append(t1)
            del out
    cpu = {name: cpu_ns(pid) - cpu0[name] for name, pid in pids.items()} if cpu0 else {}
    print(json.dumps({"model": model_name, "warmup": warmup, "begin": begin, "end": end,
                      "cpu_ns": cpu}), flush=True)
    return 0


# ----- the driver -----
def _run(cmd: list[str], env: dict[str, str], timeout: float = 600) -> tuple[dict[str, Any], str]:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                         env={**os.environ, **ENV, **env})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _latencies(result: dict[str, Any]) -> list[float]:
    w = result["warmup"]
    return [(e - b) / 1e6 for b, e in zip(result["begin"][w:], result["end"][w:], strict=True)]


def _summary(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "n": len(ms)}


def _load_hops(directory: Path) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []
    for f in directory.glob("*.json"):
        events += [(e, t) for e, t in json.loads(f.read_text())]
    events.sort(key=lambda e: e[1])
    return events


def timeline(result: dict[str, Any], events: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Per hop: median over measured inferences of its first and last time after ``app.begin``
    (ms), and how many times it happened per inference."""
    w = result["warmup"]
    windows = list(zip(result["begin"][w:], result["end"][w:], strict=True))
    per: dict[str, list[tuple[float, float, int]]] = {}
    i = 0
    for b, e in windows:
        while i < len(events) and events[i][1] < b:
            i += 1
        seen: dict[str, list[int]] = {}
        j = i
        while j < len(events) and events[j][1] <= e:
            seen.setdefault(events[j][0], []).append(events[j][1])
            j += 1
        seen.setdefault("app.end", []).append(e)
        for name, ts in seen.items():
            per.setdefault(name, []).append(((ts[0] - b) / 1e6, (ts[-1] - b) / 1e6, len(ts)))
        for name in [n[:-6] for n in seen if n.endswith(".begin") and n != "app.begin"]:
            ends = seen.get(name + ".end", [])
            if len(ends) == len(seen[name + ".begin"]):  # time inside, summed
                busy = sum(y - x for x, y in zip(seen[name + ".begin"], ends, strict=True)) / 1e6
                per.setdefault(name + " (total)", []).append((busy, busy, len(ends)))
    order = ["app.begin", *HOPS, "app.end"]
    rows = [{"hop": "app.begin", "first_ms": 0.0, "last_ms": 0.0, "count": 1.0}]
    for name in sorted(per, key=lambda n: (order.index(n) if n in order else len(order),
                                          statistics.median(x[0] for x in per[n]))):
        xs = per[name]
        rows.append({"hop": name, "first_ms": statistics.median(x[0] for x in xs),
                     "last_ms": statistics.median(x[1] for x in xs),
                     "count": sum(x[2] for x in xs) / len(windows)})
    return rows


# The path of one replayed inference as segments between hops (per inference, then median):
# (name, from-hop, which occurrence, to-hop, which occurrence). "first" after the previous
# point of the chain, "last" in the inference's window.
SEGMENTS = (
    ("shim: app call -> start sent", "app.begin", "first", "shim.send", "first"),
    ("unix socket up -> robot reads", "shim.send", "first", "robot.up.read", "first"),
    ("robot relay + gRPC up -> GPU daemon reads", "robot.up.read", "first", "gpu.up.read",
     "first"),
    ("GPU loop -> worker thread", "gpu.up.read", "first", "gpu.work.begin", "first"),
    ("host replay (+ later inputs) -> last output", "gpu.work.begin", "first", "gpu.emit", "last"),
    ("worker -> GPU loop yields", "gpu.emit", "last", "gpu.down.yield", "last"),
    ("gRPC down -> robot reads", "gpu.down.yield", "last", "robot.down.read", "last"),
    ("robot relay + unix socket down -> shim", "robot.down.read", "last", "shim.recv", "last"),
    ("shim -> app has its outputs", "shim.recv", "last", "app.end", "last"),
)


def segments(result: dict[str, Any], events: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Median over the measured inferences of each segment of ``SEGMENTS`` (ms); an inference
    whose chain misses a hop is left out of the segments after it."""
    w = result["warmup"]
    per: dict[str, list[float]] = {name: [] for name, *_ in SEGMENTS}
    i = 0
    for b, e in zip(result["begin"][w:], result["end"][w:], strict=True):
        while i < len(events) and events[i][1] < b:
            i += 1
        window = [("app.begin", b)]
        j = i
        while j < len(events) and events[j][1] <= e:
            window.append(events[j])
            j += 1
        window.append(("app.end", e))
        t_prev = b
        for name, _src, _, dst, which in SEGMENTS:
            ts = [t for n, t in window if n == dst and t >= t_prev]
            if not ts:
                break
            t = ts[0] if which == "first" else ts[-1]
            per[name].append((t - t_prev) / 1e6)
            t_prev = t
    return [{"segment": name, "median_ms": statistics.median(v) if v else None, "n": len(v)}
            for name, v in per.items()]


def run(models: list[str], iters: int, warmup: int, hops: bool = True) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from testkit.daemons import Launcher

    results: dict[str, Any] = {"models": {}, "iters": iters, "warmup": warmup, "hops": hops}
    app_cmd = [sys.executable, "-m", "bench.plumbing", "app", "--iters", str(iters),
               "--warmup", str(warmup)]
    with tempfile.TemporaryDirectory(prefix="rrto-hops-") as trace_dir:
        trace = {"RRTO_HOP_TRACE": trace_dir} if hops else {}
        nto = subprocess.Popen([sys.executable, "-m", "bench.nto", "serve"], cwd=REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **ENV})
        try:
            port = int(nto.stdout.readline().split()[1])  # type: ignore[union-attr]
            with Launcher(extra_env={**ENV, **trace}) as launcher:
                gpu = launcher.start("gpu", roles=["gpu"])
                robot = launcher.start("robot", roles=["robot"],
                                       hosts=[{"name": "gpu", "address": gpu.listen}])
                robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="GPU host up")
                for m in models:
                    row: dict[str, Any] = {}
                    local, _ = _run([*app_cmd, "--model", m], {})
                    row["local"] = _summary(_latencies(local))
                    client, _ = _run([sys.executable, "-m", "bench.nto", "client", "--model", m,
                                      "--target", f"127.0.0.1:{port}", "--iters", str(iters),
                                      "--warmup", str(warmup)], {})
                    row["nto"] = _summary(client["latency_ms"])
                    cpu_of = f"robot={robot.proc.pid},gpu={gpu.proc.pid}"
                    rr, err = _run([str(BIN / "rrto-run"), *app_cmd, "--model", m,
                                    "--cpu-of", cpu_of], {**robot.env, **RRTO_ENV, **trace})
                    row["rrto"] = _summary(_latencies(rr))
                    row["rrto"]["cpu_ms"] = {k: v / 1e6 / iters for k, v in rr["cpu_ns"].items()}
                    row["shim"] = shim_stats(err)
                    row["_raw"] = rr
                    results["models"][m] = row
                # The daemons write their hops at exit.
        finally:
            if nto.stdin:
                nto.stdin.close()
            nto.wait(10)
        if hops:
            events = _load_hops(Path(trace_dir))
            for row in results["models"].values():
                row["timeline"] = timeline(row["_raw"], events)
                row["segments"] = segments(row["_raw"], events)
    for row in results["models"].values():
        del row["_raw"]
    return results


def report(results: dict[str, Any], verbose: bool = False) -> str:
    lines = ["| model | local ms | nto ms | rrto ms | rrto p90 | rrto − nto | round trips/inf "
             "| rrto CPU ms/inf: app, robot, gpu |", "|---|---|---|---|---|---|---|---|"]
    for m, r in results["models"].items():
        shim = r.get("shim") or {}
        inf = shim.get("inferences") or 0
        rt = f"{shim['round_trips'] / inf:.2f}" if inf and "round_trips" in shim else "–"
        c = r["rrto"].get("cpu_ms", {})
        cpu = ", ".join(f"{c[k]:.2f}" for k in ("app", "robot", "gpu") if k in c)
        lines.append(f"| {m} | {r['local']['median_ms']:.3f} | {r['nto']['median_ms']:.3f} | "
                     f"{r['rrto']['median_ms']:.3f} | {r['rrto']['p90_ms']:.3f} | "
                     f"{r['rrto']['median_ms'] - r['nto']['median_ms']:+.3f} | {rt} | {cpu} |")
    traced = {m: r for m, r in results["models"].items() if "segments" in r}
    if traced:
        lines += ["", "One replayed inference, segment by segment (median ms):", "",
                  "| segment | " + " | ".join(traced) + " |",
                  "|---|" + "---|" * len(traced)]
        for k, (name, *_) in enumerate(SEGMENTS):
            cells = [r["segments"][k]["median_ms"] for r in traced.values()]
            lines.append(f"| {name} | " + " | ".join("–" if c is None else f"{c:.3f}"
                                                     for c in cells) + " |")
    for m, r in results["models"].items():
        if "timeline" not in r or not verbose:
            continue
        lines += ["", f"{m}: one replayed inference, median ms after app.begin", "",
                  "| hop | first | last | per inference |", "|---|---|---|---|"]
        for h in r["timeline"]:
            lines.append(f"| {h['hop']} | {h['first_ms']:.3f} | {h['last_ms']:.3f} | "
                         f"{h['count']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.plumbing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    a = sub.add_parser("app", help="the plain-torch app (run under rrto-run for offloading)")
    a.add_argument("--model", required=True)
    a.add_argument("--iters", type=int, default=50)
    a.add_argument("--warmup", type=int, default=10)
    a.add_argument("--cpu-of", default="", help="NAME=PID,...: processes whose CPU to report")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-hops", action="store_true", help="no hop timestamps")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--timeline", action="store_true", help="every hop, per model")
    args = parser.parse_args(argv)
    if args.cmd == "app":
        pids = dict(p.split("=") for p in args.cpu_of.split(",") if p)
        return app(args.model, args.iters, args.warmup, {k: int(v) for k, v in pids.items()})
    results = run(args.models.split(","), args.iters, args.warmup, hops=not args.no_hops)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(report(results, verbose=args.timeline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
