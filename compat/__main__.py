"""Run the compatibility corpus: every entry of compat/models.yaml (and the idiom apps of
compat/idioms/) locally and under ``rrto-run`` against one rrtod (robot + GPU roles) on this
machine, compare outputs, and rewrite docs/compatibility.md with what each run measured.

    python -m compat                         # everything (make compat)
    python -m compat --only tv-resnet50,hf-vit --timeout 300
    python -m compat --idioms-only
    python -m compat --ci --strict --results build/compat-ci/latest.json \
        --doc build/compat-ci/compatibility.md   # CI's subset (make compat-ci)

Each app runs in its own process under a time limit, so a crash or a hang costs one row. The
figures come from what the shim and the daemon already report: the shim's ``RRTO_STATS`` line at
exit, and ``rrtoctl status`` read by the driver while the app waits at its ``MARK`` lines
around the last ``--window`` frames (so bytes on the wire are those of steady inferences).

The exit status is 0 once every entry ran, whatever its row says (the table is the result);
with ``--strict`` it is 1 when any entry of this run is not ``ok``, as CI needs. The README's
counts block is rewritten only by a run that writes the committed page (``--doc`` left at
docs/compatibility.md), so a CI run into build/ leaves the tree as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from compat.report import update_readme, write_report
from testkit.apps import shim_stats
from testkit.daemons import Launcher

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).resolve().parent / "models.yaml"
BIN = Path(sys.executable).parent
RESULTS = ROOT / "compat" / "results" / "latest.json"
DOC = ROOT / "docs" / "compatibility.md"
README = ROOT / "README.md"


def app_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RRTO_")}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


class Run:
    """One app process with a deadline: stdout lines, ``MARK`` handshakes, then its exit."""

    def __init__(self, cmd: list[str], env: dict[str, str], timeout: float):
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.deadline = time.monotonic() + timeout
        self.err_path = None

    def lines(self):
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            yield line.rstrip("\n")

    def reply(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_app(cmd: list[str], env: dict[str, str], timeout: float,
            on_mark: Any = None) -> dict[str, Any]:
    """Runs ``cmd``; returns rc, RESULT json, rrto-stats json, stderr tail, marks' data."""
    import threading
    run = Run(cmd, env, timeout)
    timer = threading.Timer(timeout, run.kill)
    timer.start()
    result: dict[str, Any] = {"marks": []}
    out_lines = []
    try:
        for line in run.lines():
            out_lines.append(line)
            if line == "MARK":
                result["marks"].append(on_mark(run.proc.pid) if on_mark else None)
                run.reply()
            elif line.startswith("RESULT "):
                result["app"] = json.loads(line.removeprefix("RESULT "))
        _, err = run.proc.communicate(timeout=max(1.0, run.deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        run.kill()
        _, err = run.proc.communicate()
    finally:
        timer.cancel()
    result["rc"] = run.proc.returncode
    result["timed_out"] = time.monotonic() >= run.deadline
    result["stderr_tail"] = err[-4000:]
    stats = shim_stats(err)
    if stats is not None:
        result["stats"] = stats
    result["warnings"] = sorted({ln.strip() for ln in err.splitlines()
                                 if ln.startswith("rrto: ") or "rrto" in ln and "warning" in ln})
    return result


def compare(local: Path, remote: Path) -> dict[str, Any]:
    a, b = np.load(local), np.load(remote)
    if sorted(a.files) != sorted(b.files):
        return {"equal": False, "why": f"different outputs: {sorted(set(a.files) ^ set(b.files))[:5]}"}
    worst, bitwise = 0.0, True
    for k in a.files:
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            return {"equal": False, "why": f"{k}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"}
        if x.tobytes() != y.tobytes():
            bitwise = False
            if x.size:
                worst = max(worst, float(np.nanmax(np.abs(x.astype(np.float64)
                                                          - y.astype(np.float64)))))
    return {"bitwise": bitwise, "max_abs_diff": worst, "outputs": len(a.files)}


def session_figures(daemon: Any, pid: int) -> dict[str, Any]:
    status = daemon.ctl("status")
    for s in status.get("sessions", []):
        if s["pid"] == pid:
            return {k: s.get(k) for k in ("bytes_up", "bytes_down", "frames_up", "frames_down",
                                         "ops_forwarded", "inferences", "record")}
    return {}


def reason_from_log(daemon: Any, since: int) -> list[str]:
    """The daemon's own words about this app's record/replay (lines logged since ``since``)."""
    keep = ("sequence", "search", "refused", "mismatch", "replay", "error", "fallback")
    found = []
    for line in daemon.logs()[since:].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        event = str(rec.get("event", ""))
        if any(k in event for k in keep) and rec.get("level") in ("info", "warning", "error"):
            found.append(event + "".join(f" {k}={rec[k]}" for k in ("error", "reason", "op")
                                         if k in rec))
    return found[-6:]


def measure(entry: dict[str, Any], daemon: Any, args: argparse.Namespace,
            tmp: Path) -> dict[str, Any]:
    """One corpus entry, local then offloaded; the row of the table."""
    name = entry["name"]
    cmd = [sys.executable, "-m", entry.get("module", "compat.app"), "--entry", json.dumps(entry),
           "--frames", str(args.frames)]
    row: dict[str, Any] = {"name": name, "library": entry["library"],
                           "tolerance": entry.get("tolerance")}
    t0 = time.monotonic()
    local = run_app([*cmd, "--dump", str(tmp / f"{name}-local.npz")], app_env({}), args.timeout)
    row["local_s"] = round(time.monotonic() - t0, 1)
    if local["rc"] != 0 or "app" not in local:
        row.update(status="local-fails", symptom=_last_line(local))
        return row
    daemon.ctl("flush", "--all")
    log_at = len(daemon.logs())
    env = app_env({**daemon.env, "RRTO_STATS": "1", "RRTO_FALLBACK": "local"})
    t0 = time.monotonic()
    remote = run_app([str(BIN / "rrto-run"), "--", *cmd, "--window", str(args.window),
                      "--dump", str(tmp / f"{name}-remote.npz")], env, args.timeout,
                     on_mark=lambda pid: session_figures(daemon, pid))
    row["offloaded_s"] = round(time.monotonic() - t0, 1)
    row["warnings"] = remote["warnings"][:5]
    row["daemon_says"] = reason_from_log(daemon, log_at)
    stats = remote.get("stats", {})
    if remote["timed_out"]:
        row.update(status="timeout", symptom=f"no exit within {args.timeout:.0f} s")
    elif remote["rc"] != 0 or "app" not in remote:
        row.update(status="crash", symptom=_last_line(remote))
    else:
        row.update(compare(tmp / f"{name}-local.npz", tmp / f"{name}-remote.npz"))
        tol = entry.get("tolerance")
        ok = row.get("bitwise") or (tol is not None and row.get("max_abs_diff", 1) <= tol["abs"])
        row["status"] = "ok" if ok else "differs"
        if not ok and "why" not in row:
            row["symptom"] = f"max abs diff {row.get('max_abs_diff')}"
        elif "why" in row:
            row["symptom"] = row["why"]
    if stats:
        inf = max(1, stats.get("inferences", 0))
        ops = stats.get("calls", 0) + stats.get("replayed_ops", 0) + stats.get("local_ops", 0)
        by = stats.get("by_inference", {})
        row.update(inferences=stats.get("inferences"), ops_per_inference=round(ops / inf, 1),
                   forwarded_ops=stats.get("calls", 0), local_ops=stats.get("local_ops", 0),
                   replays=stats.get("replays", 0), mismatches=stats.get("mismatches", 0),
                   replay_failed=stats.get("failed", 0),
                   steady_round_trips=(by.get("round_trips") or [None])[-1],
                   by_inference=by)
    marks = [m for m in remote["marks"] if m]
    if len(marks) == 2 and remote.get("app"):
        w = args.window
        a, b = marks
        row["wire_bytes_per_inference"] = round(
            (b["bytes_up"] + b["bytes_down"] - a["bytes_up"] - a["bytes_down"]) / w)
        row["record"] = b.get("record")
    if remote.get("app"):
        io = remote["app"]["input_bytes"] + remote["app"]["output_bytes"]
        row.update(io_bytes_per_inference=io, latency_local_s=local["app"]["latency_s"],
                   latency_offloaded_s=remote["app"]["latency_s"],
                   latencies_local_s=local["app"].get("latencies_s"),
                   latencies_offloaded_s=remote["app"].get("latencies_s"))
    if row["status"] != "ok":
        row["stderr_tail"] = remote["stderr_tail"][-1500:]
    return row


def _last_line(result: dict[str, Any]) -> str:
    lines = [ln for ln in result["stderr_tail"].splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errs or lines or [f"exit {result['rc']}"])[-1][:300]


def load_entries(args: argparse.Namespace) -> list[dict[str, Any]]:
    entries = [] if args.idioms_only else yaml.safe_load(MODELS.read_text())
    if getattr(args, "ci", False):
        entries = [e for e in entries if e.get("ci")]
    if not args.models_only:
        from compat.idioms import IDIOMS
        entries += [{"name": f"idiom-{n}", "library": "idiom", "module": "compat.idioms.run",
                     "idiom": n} for n in IDIOMS]
    if args.only:
        names = set(args.only.split(","))
        entries = [e for e in entries if e["name"] in names]
    return entries


def load_entries_all() -> list[str]:
    """Every entry's name, in table order."""
    return [e["name"] for e in load_entries(argparse.Namespace(
        idioms_only=False, models_only=False, only=None))]


def round_robin(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run order: one entry of each library in turn, so that a run cut short has covered
    every library (the table keeps the order of models.yaml)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by.setdefault(e["library"], []).append(e)
    out = []
    while any(by.values()):
        for queue in by.values():
            if queue:
                out.append(queue.pop(0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m compat", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated entry names")
    p.add_argument("--models-only", action="store_true")
    p.add_argument("--idioms-only", action="store_true")
    p.add_argument("--ci", action="store_true",
                   help="only the models marked `ci: true` in models.yaml (and every idiom)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when an entry of this run is not ok (CI)")
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--window", type=int, default=2, help="steady frames measured at the end")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per app run")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    entries = load_entries(args)
    import torch
    meta = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "frames": args.frames, "window": args.window,
            "versions": _versions()}
    previous = json.loads(args.results.read_text())["rows"] if args.results.exists() else []
    rows: dict[str, dict[str, Any]] = {r["name"]: r for r in previous}
    this_run: list[dict[str, Any]] = []
    args.results.parent.mkdir(parents=True, exist_ok=True)
    # One thread on both sides, as the app (compat/app.py): the host then runs each operator
    # with the kernels and summation order that local execution used, so outputs can be bitwise.
    daemon_env = {"PYTHONPATH": str(ROOT), "RRTO_OFFLOAD": "0", "OMP_NUM_THREADS": "1"}
    with Launcher(extra_env=daemon_env) as launcher, \
            tempfile.TemporaryDirectory(prefix="rrto-compat-") as tmp:
        daemon = launcher.start("rrtod", log={"format": "json", "level": "info"})
        for entry in round_robin(entries):
            t0 = time.monotonic()
            row = measure(entry, daemon, args, Path(tmp))
            row["measured"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            rows[entry["name"]] = row
            this_run.append(row)
            print(f"{entry['name']:40s} {row['status']:12s} {time.monotonic() - t0:6.1f} s "
                  f"{row.get('symptom', '')[:100]}", flush=True)
            ordered = [rows[n] for n in load_entries_all() if n in rows]
            args.results.write_text(json.dumps({"meta": meta, "rows": ordered}, indent=1,
                                               default=str))
            write_report(args.doc, meta, ordered)
            if args.doc.resolve() == DOC.resolve():
                update_readme(README, meta, ordered)
    failed = failures(this_run)
    for line in failed:
        print(f"FAILED {line}", flush=True)
    print(f"{len(this_run) - len(failed)} of {len(this_run)} entries ok; table: {args.doc}",
          flush=True)
    return 1 if args.strict and (failed or not this_run) else 0


def failures(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row that is not ``ok`` (its name, status and symptom): what ``--strict``
    fails on."""
    return [f"{r['name']}: {r['status']} {r.get('symptom', '')}".rstrip()
            for r in rows if r.get("status") != "ok"]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("torch", "torchvision", "timm", "transformers", "ultralytics", "rrtod"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "-"
    return out


if __name__ == "__main__":
    sys.exit(main())
