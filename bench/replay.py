"""Figures for the record/replay issue note, per model of the correctness suite (tests/apps).

    .venv/bin/python -m bench.replay [--runs 20] [--warm 8] [--models resnet,unet]
                                     [--link wifi6-edge]

For each model the unmodified app script (``tests/apps/NAME.py --runs N``) runs five times:
``local`` (no offloading), ``sync`` (``rrto-run --sync``, replay off: per-op forwarding),
``stream`` (replay off: streamed forwarding, the record path), ``replay`` (replay on, saved
sequences flushed first, so it records, searches and then replays) and ``restart`` (replay on
again without a flush: the restarted app finds the saved sequence). Daemons run on loopback
(one ``rrtod`` with both roles), or with ``--link`` a GPU daemon behind the emulated link of
bench/link.py and a robot daemon in front of it.

How it measures. The app script runs inside a small driver (``--child``, this module) that
changes nothing in it: the driver wraps ``appkit.main``'s input maker and ``appkit.describe``
(which downloads and prints every output) to time each inference, from the moment its input
exists to the moment all its outputs are read and printed. After each inference it copies the
shim's own counters (``rrtod.shim.activate.interceptor().stats()``, read-only, the same figures
``RRTO_STATS=1`` prints at exit). After inference ``--warm`` and after the last one the app
pauses while this process reads the robot daemon's counters for its session (``status``).

Steady state is the window of inferences ``warm+1 .. runs``: every per-inference figure (round
trips the app waited for, frames, wire bytes of frames, tensor bytes, latency medians, shim time
per replayed op) is the difference of the counters at the two pauses divided by the window's
length, for every mode alike. For ``replay`` the window must consist of replayed inferences only
(checked from the shim's replay counter; the table says when it does not). Daemon counters are
read 50 ms after the app paused, so frames still in flight are counted in the next window.

The check of the issue: wire bytes per replayed inference (frames up+down as the robot daemon
counts them) <= 1.02 x the app's input + output tensor bytes + 2 KiB, where the tensor bytes are
what the app itself passes in and reads out (measured in the app, not by the shim). Outputs of
every offloaded mode must equal the local run's printed lines (the transformer: values within
1e-5, as in tests/test_torch_apps.py). Writes bench/results/replay.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.stats import SHIM_US_PER_OP_MAX  # stdlib only: fine inside the app process
from testkit.apps import (  # stdlib only too
    APPS,
    MODELS,
    STATS_PREFIX,
    TOLERANCE,
    app_env,
    compare_outputs,
    shim_stats,
)

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = REPO / "bench" / "results"
MODES = ("local", "sync", "stream", "replay", "restart")
_OFF = {"RRTO_REPLAY": "0"}
MODE_ENV: dict[str, dict[str, str]] = {
    "sync": {"RRTO_MODE": "sync", **_OFF},
    "stream": {"RRTO_MODE": "stream", **_OFF},
    "replay": {"RRTO_MODE": "stream", "RRTO_REPLAY": "1"},
    "restart": {"RRTO_MODE": "stream", "RRTO_REPLAY": "1"},
}
PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}  # see bench/harness.py: idle OpenMP spinning
MARK = "@rrto-bench "  # driver -> this process, on the app's stdout
SHIM_KEYS = ("calls", "ops", "frames", "round_trips", "bytes_up", "bytes_down", "replays",
             "mismatches", "replayed_ops", "replay_shim_s", "replay_timed", "shim_s", "failed",
             "dropped")
DAEMON_KEYS = ("ops_forwarded", "frames_up", "frames_down", "bytes_up", "bytes_down",
               "inferences")
WIRE_FACTOR, WIRE_SLACK = 1.02, 2048
SETTLE_S = 0.05
SHIM_US_TARGET = SHIM_US_PER_OP_MAX  # the target


# ---------------------------------------------------------------------------------------------
# The driver inside the app process (stdlib at import: the shim activates with torch, named
# after the app script, exactly as when the script runs by itself).
# ---------------------------------------------------------------------------------------------
def child(name: str, runs: int, warm: int, result: str, values: bool) -> int:
    import hashlib
    import runpy

    script = APPS / f"{name}.py"
    sys.argv = [str(script), "--runs", str(runs)]
    sys.path.insert(0, str(APPS))
    import appkit  # imports torch: the shim (if any) activates here

    shim_mod = sys.modules.get("rrtod.shim.activate")
    itc = shim_mod.interceptor() if shim_mod is not None else None
    captured: list[bytes] = []

    class _Hashlib:  # appkit.describe hashes each output's bytes: keep a copy of them
        @staticmethod
        def sha256(data: bytes) -> Any:
            captured.append(bytes(data))
            return hashlib.sha256(data)

    appkit.hashlib = _Hashlib
    state: dict[str, Any] = {"t0": 0.0, "in_bytes": 0}
    records: list[dict[str, Any]] = []
    dumped: dict[str, list[float]] = {}
    real_main, real_describe = appkit.main, appkit.describe

    def timed_input(make: Callable[[int], Any]) -> Callable[[int], Any]:
        def make_input(i: int) -> Any:
            x = make(i)  # "grab a frame": untimed
            state["in_bytes"] = sum(t.nelement() * t.element_size() for t in appkit.flat(x))
            state["t0"] = time.perf_counter()
            return x
        return make_input

    def describe(index: int, outputs: Any) -> list[str]:
        dtypes = [t.dtype for t in appkit.flat(outputs)]  # metadata only: no operator
        first = len(captured)
        lines = real_describe(index, outputs)
        t1 = time.perf_counter()
        out = captured[first:]
        rec: dict[str, Any] = {"i": index, "ms": (t1 - state["t0"]) * 1e3,
                               "in_bytes": state["in_bytes"],
                               "out_bytes": sum(len(b) for b in out)}
        if itc is not None:
            stats = itc.stats()
            rec["shim"] = {k: stats.get(k, 0) for k in SHIM_KEYS}
        records.append(rec)
        if values:
            import numpy as np
            import torch
            for k, (dt, data) in enumerate(zip(dtypes, out, strict=True)):
                np_dt = torch.empty(0, dtype=dt).numpy().dtype
                dumped[f"{index}:{k}"] = np.frombuffer(data, np_dt).astype(float).tolist()
        if index + 1 in (warm, runs):
            print(MARK + json.dumps({"phase": "warm" if index + 1 == warm else "end",
                                     "inferences": index + 1}), flush=True)
            sys.stdin.readline()
        return lines

    def main(build: Any, make_input: Any, mode: str = "no_grad", runs: int = 3,
             post: Any = None) -> None:
        real_main(build, timed_input(make_input), mode, runs, post)

    appkit.main, appkit.describe = main, describe
    runpy.run_path(str(script), run_name="__main__")
    Path(result).write_text(json.dumps({"records": records, "values": dumped,
                                        "offloaded": itc is not None}))
    return 0


# ---------------------------------------------------------------------------------------------
# Pure figures (tests/test_bench_replay.py)
# ---------------------------------------------------------------------------------------------
def shim_us_per_op(s: dict[str, Any]) -> float | None:
    """The shim's mean CPU time per replayed call: ``replay_shim_s`` is the sum over the
    calls it timed (``replay_timed``, a random share of them); a shim that times every call
    reports no ``replay_timed`` and ``replayed_ops`` counts them."""
    timed = s.get("replay_timed") or s.get("replayed_ops")
    return s["replay_shim_s"] / timed * 1e6 if timed else None


def diff(a: dict[str, Any] | None, b: dict[str, Any] | None,
         keys: tuple[str, ...]) -> dict[str, float] | None:
    """``b - a`` per key (missing keys count 0); None if either snapshot is missing."""
    if a is None or b is None:
        return None
    return {k: (b.get(k) or 0) - (a.get(k) or 0) for k in keys}


def median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def first_replayed(records: list[dict[str, Any]]) -> int | None:
    """1-based index of the first inference during which the shim started a replay."""
    before = 0
    for n, rec in enumerate(records, 1):
        now = (rec.get("shim") or {}).get("replays", 0)
        if now > before:
            return n
        before = now
    return None


def window_figures(records: list[dict[str, Any]], warm: int,
                   daemon_warm: dict[str, Any] | None,
                   daemon_end: dict[str, Any] | None) -> dict[str, Any]:
    """Per-inference figures over the inferences after ``warm`` (see the module doc)."""
    win = records[warm:]
    n = len(win)
    out: dict[str, Any] = {"n": n, "latency_ms": median([r["ms"] for r in win]),
                           "latency_p90_ms": _p90([r["ms"] for r in win]),
                           "latency_samples_ms": [round(r["ms"], 4) for r in win]}
    if not n:
        return out
    out["io_bytes"] = sum(r["in_bytes"] + r["out_bytes"] for r in win) / n
    if warm >= 1 and all("shim" in r for r in records[warm - 1:]):
        s = diff(records[warm - 1]["shim"], records[-1]["shim"], SHIM_KEYS)
        assert s is not None
        out["shim"] = {k: v / n for k, v in s.items()}
        out["all_replayed"] = s["replays"] == n and s["mismatches"] == 0
        out["shim_us_per_replayed_op"] = shim_us_per_op(s)
    d = diff(daemon_warm, daemon_end, DAEMON_KEYS)
    if d is not None:
        out["daemon"] = {k: v / n for k, v in d.items()}
        out["wire_bytes"] = (d["bytes_up"] + d["bytes_down"]) / n
    return out


def _p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * 0.9
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def wire_check(wire_bytes: float | None, io_bytes: float | None) -> dict[str, Any]:
    """Wire bytes per replayed inference against 1.02 x input+output tensor bytes + 2 KiB."""
    if wire_bytes is None or io_bytes is None:
        return {"ok": None, "limit": None}
    limit = WIRE_FACTOR * io_bytes + WIRE_SLACK
    return {"ok": wire_bytes <= limit, "limit": limit, "overhead": wire_bytes - io_bytes}


# ---------------------------------------------------------------------------------------------
# Running apps and daemons
# ---------------------------------------------------------------------------------------------
def _session(status: dict[str, Any], pid: int) -> dict[str, Any] | None:
    for s in status.get("sessions") or []:
        if s.get("pid") == pid:
            return s
    return None


def _daemon_notes(text: str) -> dict[str, Any]:
    """A daemon log (JSON lines): its warnings and errors, and how often each info event came."""
    warnings: list[str] = []
    events: dict[str, int] = {}
    for line in text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            if line.strip():
                warnings.append(line.strip()[:400])
            continue
        if not isinstance(ev, dict):
            continue
        if ev.get("level") in ("warning", "error", "critical"):
            warnings.append(json.dumps(ev)[:600])
        else:
            events[str(ev.get("event"))] = events.get(str(ev.get("event")), 0) + 1
    return {"warnings": warnings, "events": events}


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.robot: Any = None
        self.daemons: list[Any] = []
        self.link_info: dict[str, Any] | None = None

    # ---- daemons ----
    def start(self, stack: Any) -> None:
        from testkit.daemons import Launcher

        launcher = stack.enter_context(Launcher(extra_env={"RRTO_OFFLOAD": "0", **PROCESS_ENV}))
        log = {"format": "json", "level": "info"}
        if not self.args.link:
            self.robot = launcher.start("rrtod", log=log)
            self.daemons = [self.robot]
            return
        from bench.link import LINKS, LinkProcess, MeasureServer, measure

        spec = LINKS[self.args.link]
        gpu = launcher.start("gpu", roles=["gpu"], log=log)
        server = MeasureServer()
        stack.callback(server.close)
        link = stack.enter_context(LinkProcess(spec, [gpu.listen, server.address]))
        delay = link.calibrate(link.address(1))
        self.robot = launcher.start("robot", roles=["robot"], log=log,
                                    hosts=[{"name": "gpu", "address": link.address(0)}])
        self.robot.wait_for(lambda s: s["hosts"] and s["hosts"][0]["state"] == "up",
                            timeout=30, what="GPU host up")
        self.daemons = [self.robot, gpu]
        self.link_info = {"name": spec.name, "one_way_delay_s": delay,
                          "measured": measure(link.address(1), spec, link).to_dict()}

    def ctl(self, command: str, **args: str) -> Any:
        from rrtod.ctl import request

        return request(self.robot.socket, command, args)

    def log_offsets(self) -> list[int]:
        return [d.log_path.stat().st_size if d.log_path.exists() else 0 for d in self.daemons]

    def logs_since(self, offsets: list[int]) -> str:
        parts = []
        for d, off in zip(self.daemons, offsets, strict=True):
            with open(d.log_path, "rb") as f:
                f.seek(off)
                parts.append(f.read().decode(errors="replace"))
        return "".join(parts)

    # ---- one app run ----
    def run_app(self, name: str, mode: str) -> dict[str, Any]:
        a = self.args
        result_path = self.tmp / f"{name}-{mode}.json"
        cmd = [sys.executable, "-m", "bench.replay", "--child", name, "--runs", str(a.runs),
               "--warm", str(a.warm), "--result", str(result_path)]
        if name in TOLERANCE:
            cmd.append("--values")
        env = app_env(**PROCESS_ENV)
        offloaded = mode != "local"
        if offloaded:
            env.update(self.robot.env, RRTO_STATS="1", RRTO_FALLBACK="error", **MODE_ENV[mode])
            cmd = [str(BIN / "rrto-run"), "--", *cmd]
            if mode == "replay":
                self.ctl("flush", all="1")  # record from scratch: no saved sequence restored
        offsets = self.log_offsets() if offloaded else []
        run: dict[str, Any] = {"mode": mode, "status": "ok", "error": None}
        snaps: dict[str, Any] = {}
        lines: list[str] = []
        t0 = time.monotonic()
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, text=True, cwd=str(REPO), env=env)
            killed = threading.Event()

            def kill() -> None:
                killed.set()
                proc.kill()

            timer = threading.Timer(a.timeout, kill)
            timer.start()
            try:
                assert proc.stdout is not None and proc.stdin is not None
                for line in proc.stdout:
                    if not line.startswith(MARK):
                        lines.append(line)
                        continue
                    msg = json.loads(line[len(MARK):])
                    if offloaded:
                        time.sleep(SETTLE_S)
                        try:
                            snaps[msg["phase"]] = _session(self.ctl("status"), proc.pid)
                        except Exception as e:  # noqa: BLE001 - reported, the run goes on
                            run["error"] = f"status at {msg['phase']}: {e}"
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            err.seek(0)
            stderr = err.read()
        run["wall_s"] = round(time.monotonic() - t0, 3)
        run["returncode"] = proc.returncode
        run["shim_stats"] = shim_stats(stderr)
        other = [x for x in stderr.splitlines() if not x.startswith(STATS_PREFIX)]
        if other:
            run["stderr_tail"] = other[-25:]
        if proc.returncode != 0 or not result_path.exists():
            why = "killed after --timeout (hung?)" if killed.is_set() else \
                f"exit {proc.returncode}"
            run.update(status="failed", error=f"{why}: " + " | ".join(other[-6:]))
        if offloaded:
            try:  # the session must close; its sequences' figures are final then
                self.robot.wait_for(lambda s: not s["sessions"], timeout=30,
                                    what="session closed")
            except Exception as e:  # noqa: BLE001
                run["error"] = (run["error"] or "") + f"; session did not close: {e}"
            if mode in ("replay", "restart"):
                run["sequences"] = [s for s in self.ctl("sequences")["sequences"]
                                    if s.get("app") == f"{name}.py"]
            run["daemon_log"] = _daemon_notes(self.logs_since(offsets))
        run["output"] = "".join(lines)
        if result_path.exists():
            doc = json.loads(result_path.read_text())
            recs = doc["records"]
            run["values"] = doc["values"]
            run["offloaded"] = doc["offloaded"]
            if offloaded and not doc["offloaded"]:
                run.update(status="failed", error="ran locally: the shim did not activate")
            run["first_replayed"] = first_replayed(recs)
            run["window"] = window_figures(recs, a.warm, snaps.get("warm"), snaps.get("end"))
            if snaps.get("end"):
                run["record"] = snaps["end"].get("record")
            run["inferences"] = len(recs)
            run["first_ms"] = round(recs[0]["ms"], 3) if recs else None
        return run


def summarize_model(name: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table row of one model from its runs."""
    row: dict[str, Any] = {"model": name, "problems": []}
    local = runs.get("local", {})
    for mode, run in runs.items():
        if run["status"] != "ok":
            notes = (run.get("daemon_log") or {}).get("warnings") or []
            row["problems"].append(f"{mode}: {run['error']}" + (
                "; daemon log: " + " | ".join(notes[-3:]) if notes else ""))
            continue
        for w in ((run.get("daemon_log") or {}).get("warnings") or [])[:3]:
            row["problems"].append(f"{mode}: daemon warning: {w}")
        if mode != "local" and local.get("status") == "ok":
            why = compare_outputs(run["output"], local["output"], TOLERANCE.get(name),
                                  run.get("values"), local.get("values"))
            run["outputs_match_local"] = why is None
            if why:
                row["problems"].append(f"{mode}: OUTPUTS DIFFER FROM LOCAL: {why}")
        if run.get("error"):
            row["problems"].append(f"{mode}: {run['error']}")
        row[f"{mode}_ms"] = (run.get("window") or {}).get("latency_ms")
    st, rp, rs = runs.get("stream", {}), runs.get("replay", {}), runs.get("restart", {})
    sw = st.get("window") or {}
    row["ops"] = (sw.get("shim") or {}).get("calls")
    row["io_bytes"] = sw.get("io_bytes") or (local.get("window") or {}).get("io_bytes")
    row["sync_round_trips"] = ((runs.get("sync", {}).get("window") or {}).get("shim")
                               or {}).get("round_trips")
    row["record"] = {"round_trips": (sw.get("shim") or {}).get("round_trips"),
                     "frames_up": (sw.get("daemon") or {}).get("frames_up"),
                     "wire_bytes": sw.get("wire_bytes")}
    rw = rp.get("window") or {}
    row["replay"] = {"round_trips": (rw.get("shim") or {}).get("round_trips"),
                     "frames_up": (rw.get("daemon") or {}).get("frames_up"),
                     "frames_down": (rw.get("daemon") or {}).get("frames_down"),
                     "wire_bytes": rw.get("wire_bytes"),
                     "tensor_bytes": ((rw.get("shim") or {}).get("bytes_up", 0)
                                      + (rw.get("shim") or {}).get("bytes_down", 0))
                     if rw.get("shim") else None,
                     "all_replayed": rw.get("all_replayed"),
                     "shim_us_per_op": rw.get("shim_us_per_replayed_op")}
    row["first_replayed"] = rp.get("first_replayed")
    row["restart_first_replayed"] = rs.get("first_replayed")
    row["restart_round_trips"] = (rs.get("shim_stats") or {}).get("round_trips")
    seqs = rp.get("sequences") or []
    row["found_at"] = [s.get("found_at") for s in seqs]
    row["search_ms"] = [round(s["search_s"] * 1e3, 2) for s in seqs if "search_s" in s]
    searches = (rp.get("record") or {}).get("searches") or []
    row["searches_seen"] = len(searches)
    row["searches_ms"] = round(sum(s.get("seconds", 0) for s in searches) * 1e3, 2)
    row["operators"] = [s.get("operators") for s in seqs]
    row["check"] = wire_check(row["replay"]["wire_bytes"], row["io_bytes"])
    if rp.get("status") == "ok":
        if row["first_replayed"] is None:
            row["problems"].append("replay: NO INFERENCE WAS REPLAYED")
        elif not rw.get("all_replayed"):
            row["problems"].append("replay: the steady-state window is not all replayed "
                                   f"(first replayed inference {row['first_replayed']})")
        stats = rp.get("shim_stats") or {}
        if stats.get("mismatches") or stats.get("failed"):
            row["problems"].append(f"replay: mismatches {stats.get('mismatches')}, "
                                   f"failed {stats.get('failed')}")
        if row["check"]["ok"] is False:
            row["problems"].append(
                f"replay: wire {row['replay']['wire_bytes']:.0f} B/inference > limit "
                f"{row['check']['limit']:.0f} B")
        if (row["replay"]["round_trips"] or 0) > 0:
            row["problems"].append(f"replay: {row['replay']['round_trips']:.2f} round trips "
                                   "per replayed inference (target 0)")
    if rs.get("status") == "ok" and rs.get("first_replayed") != 1:
        row["problems"].append(f"restart: first replayed inference {rs.get('first_replayed')}"
                               " (expected 1: the saved sequence)")
    return row


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def _ints(xs: list[Any]) -> str:
    return ",".join(str(x) for x in xs) if xs else "-"


def render(doc: dict[str, Any]) -> str:
    p = doc["plan"]
    where = f"link {doc['link']['name']}" if doc.get("link") else "loopback"
    out = [f"# Record/replay figures ({where})", "",
           f"`{doc['command']}` — {doc['started']}, {doc['machine']}; {p['runs']} inferences per "
           f"run, steady-state window = inferences {p['warm'] + 1}..{p['runs']} "
           f"({p['runs'] - p['warm']}); per-inference figures are counter differences over that "
           "window; latencies are its medians. Load average (1 min) at start / end: "
           f"{doc['loadavg']['start'][0]} / {doc['loadavg']['end'][0]} — other processes on "
           "this machine compete for its cores, so latencies are noisy; counts and bytes are "
           "not.", *([f"Commit {(doc['git']['commit'] or '?')[:10]} with uncommitted changes in: "
                      + ", ".join(doc["git"]["changed"]) + ".", ""]
                     if (doc.get("git") or {}).get("changed") else [""]),
           *([f"Link {doc['link']['name']}, measured: RTT "
              f"{_f(doc['link']['measured'].get('rtt_ms'))} ms, up "
              f"{_f(doc['link']['measured'].get('up_mbps'), '{:.0f}')} Mbit/s, down "
              f"{_f(doc['link']['measured'].get('down_mbps'), '{:.0f}')} Mbit/s"
              + ("" if doc['link']['measured'].get('valid', True) else " (OFF TARGET: "
                 + "; ".join(doc['link']['measured'].get('problems') or []) + ")"), ""]
             if doc.get("link") else []),
           "## Record vs replay", "",
           "| model | ops/inf | per-op sync waits | first replayed inf. | found_at | search ms (found; last "
           "searches) | record: waits / frames up / wire B | replay: waits / frames up / wire B "
           "| in+out tensor B | wire check | restart: first replayed, waits (whole run) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|"]
    for r in doc["rows"]:
        rec, rep, chk = r["record"], r["replay"], r["check"]
        check = "-" if chk["ok"] is None else ("ok" if chk["ok"] else "**FAIL**")
        if chk.get("limit") is not None:
            check += f" (≤{chk['limit']:.0f})"
        out.append(
            f"| {r['model']} | {_f(r['ops'], '{:.0f}')} | {_f(r['sync_round_trips'], '{:.0f}')} "
            f"| {_f(r['first_replayed'], '{}')} "
            f"| {_ints(r['found_at'])} | {_ints(r['search_ms'])}; {r['searches_seen']} in "
            f"{r['searches_ms']} | {_f(rec['round_trips'])} / {_f(rec['frames_up'], '{:.1f}')} / "
            f"{_f(rec['wire_bytes'], '{:,.0f}')} | {_f(rep['round_trips'])} / "
            f"{_f(rep['frames_up'], '{:.1f}')} / {_f(rep['wire_bytes'], '{:,.0f}')} "
            f"| {_f(r['io_bytes'], '{:,.0f}')} | {check} "
            f"| {_f(r['restart_first_replayed'], '{}')}, {_f(r['restart_round_trips'], '{}')} |")
    out += ["", "## Latency per inference (median ms over the window)", "",
            "| model | local | per-op sync | stream | replay | replay/local | stream/replay "
            f"| shim µs per replayed op (target ≤ {SHIM_US_TARGET:g}) | outputs = local |",
            "|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in doc["rows"]:
        same = "**NO**" if any("OUTPUTS DIFFER" in x for x in r["problems"]) else "yes"
        lo, rp, st = r.get("local_ms"), r.get("replay_ms"), r.get("stream_ms")
        out.append(
            f"| {r['model']} | {_f(lo)} | {_f(r.get('sync_ms'))} | {_f(st)} | {_f(rp)} "
            f"| {_f(rp / lo if rp and lo else None, '{:.2f}x')} "
            f"| {_f(st / rp if rp and st else None, '{:.1f}x')} "
            f"| {_f(r['replay']['shim_us_per_op'], '{:.1f}')} | {same} |")
    out += ["", "Columns: *first replayed inf.* — 1-based index of the first inference the shim "
            "replayed (fresh state: sequences flushed); *found_at* — the daemon's count of "
            "inferences seen when the sequence was found; *search ms* — the successful search, "
            "then how many searches the session status still lists (its last 5) and their total; "
            "*waits* — round trips the app waited for (shim `round_trips`) per inference; *frames "
            "up* and *wire B* — the robot daemon's frame counters (app ↔ robot, protobuf bytes, "
            "up + down) per inference; *in+out tensor B* — bytes of the tensors the app passes in "
            "and reads out; *wire check* — replay wire B ≤ 1.02 × in+out + 2048; *restart* — a "
            "second replay run that starts from the saved sequence, and the round trips it waited "
            "for over the whole run (weight cache query included)."]
    events: dict[str, dict[str, int]] = {}
    for runs in (doc.get("runs") or {}).values():
        for mode, run in runs.items():
            for ev, n in ((run.get("daemon_log") or {}).get("events") or {}).items():
                if ev in ("sequence found", "no sequence matches: recording again"):
                    events.setdefault(mode, {})
                    events[mode][ev] = events[mode].get(ev, 0) + n
    if events:
        out += ["", "Robot daemon record/replay log events, summed over the models: " + "; ".join(
            f"{mode}: " + ", ".join(f"{ev} ×{n}" for ev, n in evs.items())
            for mode, evs in events.items()) + "."]
    probs = [(r["model"], p) for r in doc["rows"] for p in r["problems"]]
    out += ["", "## Anomalies", ""]
    out += [f"- **{m}**: {p}" for m, p in probs] or ["- none"]
    return "\n".join(out) + "\n"


def git_state() -> dict[str, Any]:
    """The commit, and the files changed in the working tree (others edit it concurrently)."""
    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO)
        return out.stdout.rstrip("\n")
    changed = [x[3:] for x in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {"commit": git("rev-parse", "HEAD") or None, "changed": changed}


def machine() -> str:
    import platform

    import torch
    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), OMP_WAIT_POLICY=PASSIVE")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="inferences per app run")
    p.add_argument("--warm", type=int, default=8,
                   help="inferences before the steady-state window")
    p.add_argument("--models", default="", help="comma-separated (default: all 7)")
    p.add_argument("--link", default=None, help="an emulated link of bench/link.py "
                                                "(default: loopback, no emulation)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per app run")
    p.add_argument("--out", default=str(RESULTS), help="directory for replay.md / replay.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--values", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.runs, args.warm, args.result, args.values)
    if not 1 <= args.warm < args.runs:
        p.error("need 1 <= --warm < --runs")
    for k, v in PROCESS_ENV.items():
        os.environ.setdefault(k, v)
    names = [m for m in args.models.split(",") if m] or MODELS
    unknown = [m for m in names if not (APPS / f"{m}.py").exists()]
    if unknown:
        p.error(f"unknown models: {unknown}")
    import contextlib

    started = time.time()
    load_start = os.getloadavg()
    rows, runs_doc = [], {}
    with tempfile.TemporaryDirectory(prefix="rrto-bench-replay-") as tmp, \
            contextlib.ExitStack() as stack:
        bench = Bench(args, Path(tmp))
        bench.start(stack)
        for name in names:
            runs: dict[str, dict[str, Any]] = {}
            for mode in MODES:
                run = bench.run_app(name, mode)
                runs[mode] = run
                w = run.get("window") or {}
                print(f"  {name}/{mode}: {run['status']}"
                      f" {_f(w.get('latency_ms'))} ms, first replayed "
                      f"{run.get('first_replayed')}, {run['wall_s']} s"
                      + (f"  ERROR {run['error']}" if run.get("error") else ""),
                      file=sys.stderr, flush=True)
            row = summarize_model(name, runs)
            rows.append(row)
            runs_doc[name] = {m: {k: v for k, v in r.items() if k not in ("values",)}
                              for m, r in runs.items()}
        link = bench.link_info
    doc = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
           "duration_s": round(time.time() - started, 1),
           "command": " ".join(["python -m bench.replay",
                                *(argv if argv is not None else sys.argv[1:])]),
           "machine": machine(), "git": git_state(), "link": link,
           "loadavg": {"start": [round(x, 2) for x in load_start],
                       "end": [round(x, 2) for x in os.getloadavg()]},
           "plan": {"runs": args.runs, "warm": args.warm, "models": names,
                    "modes": list(MODES), "mode_env": MODE_ENV, "process_env": PROCESS_ENV,
                    "wire_check": f"wire <= {WIRE_FACTOR} x (in+out tensor bytes) + "
                                  f"{WIRE_SLACK}"},
           "rows": rows, "runs": runs_doc}
    md = render(doc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "replay.md").write_text(md)
    print(md)
    bad = [p for r in rows for p in r["problems"]]
    if bad:
        print(f"{len(bad)} ANOMALIES (see the table)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
