"""``python -m bench.search``: the sequence searches (``dds``, ``period``) compared on the same logs.

Logs:
- the 7 test apps (tests/apps: mlp_policy, small_cnn, resnet, unet, gru, transformer, detection),
  and yolo_grid (a first inference that builds an anchor grid), run in this process through the
  shim's loopback channel (plugins/torch/testing.py): every frame the shim sends is what the
  robot daemon relays and logs, and each inference's start comes from the shim's module hooks;
- synthetic logs of 1k, 10k and 50k operators (a model-shaped inference: weights bound in the
  first inference, a constant grid, in-place writes, several downloads), and a 10k-operator log
  of a recurrent app that carries its state into the next inference (no sequence exists).

Each log is fed frame by frame into a ``rrtod.robot.recorder.Recorder`` with the daemon's default
search budget; a search runs whenever the recorder says one is due (synchronously here; the
daemon runs it in a worker thread). Reported per log and search: inferences until found, the
steady-state inference replay would start with, searches run, candidates verification rejected
(false positives), accepted sequences that are wrong (period or start other than the known
truth), and time. Then one search of each full log (time against log length), and the budget's
effect on logs where no search can succeed.

Then the same 7 apps end to end under ``rrto-run`` against a real ``rrtod`` (robot+gpu): the
daemon's ``found_at`` and the shim's replay count, with inferences back to back and paced
(a pause after each, as a robot loop paced by its sensors has). ``--no-daemon`` skips this.

Writes bench/results/search.md and bench/results/search.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import runpy
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rrto.v1 import ops_pb2
from rrto_plugins.search.dds import DataDependencySearch
from rrto_plugins.search.period import PeriodSearch
from rrtod.robot.oplog import OpLog
from rrtod.robot.recorder import Recorder, SearchBudget
from rrtod.robot.search import search_log
from testkit.apps import APPS, MODELS, app_env, shim_stats
from testkit.frames import ShimFrames

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
EXTRA = ["yolo_grid"]  # an init phase: the first inference builds and caches a grid
BIN = Path(sys.executable).parent
# A test app with a pause after each inference's outputs are read (a paced robot loop).
PACED = """
import runpy, sys, time
apps, name, pause, runs = sys.argv[1:5]
sys.path.insert(0, apps)
import appkit
describe = appkit.describe
def paced(index, outputs):
    lines = describe(index, outputs)
    time.sleep(float(pause))
    return lines
appkit.describe = paced
sys.argv = [name + ".py", "--runs", runs]
runpy.run_path(f"{apps}/{name}.py", run_name="__main__")
"""
SEARCHES = {"dds": DataDependencySearch, "period": PeriodSearch}


@dataclass
class Recording:
    """A session's frames as the robot relays them, with the app's inference marks."""

    name: str
    events: list[tuple[str, Any]] = field(default_factory=list)  # ("frame", SessionUp) | ("mark", i)
    inference_of: dict[int, int] = field(default_factory=dict)  # call seq -> inference (1-based)
    carried: bool = False  # no sequence exists (state carried across inferences)

    def calls(self) -> list[ops_pb2.OpCall]:
        return [f.call for kind, f in self.events if kind == "frame" and f.WhichOneof("msg") == "call"]

    def truth(self) -> dict[str, Any]:
        """Per inference, its calls' operator keys: the steady state is the run of inferences
        equal to the last one; its length is the true period."""
        log = OpLog(max_calls=1 << 40)
        for kind, f in self.events:
            if kind == "frame":
                log.record(f)
        by_inf: dict[int, list[int]] = {}
        starts: set[int] = set()
        for e in log.entries():
            k = max(1, self.inference_of.get(e.seq, 1))  # calls before the first: part of it
            if k not in by_inf:
                starts.add(e.seq)
            by_inf.setdefault(k, []).append(e.key)
        order = sorted(by_inf)
        last = by_inf[order[-1]]
        warmup = 0
        for k in order:
            if by_inf[k] == last:
                break
            warmup += 1
        return {"period": len(last), "inferences": max(order), "warmup": warmup,
                "calls": len(log), "starts": starts}


# ----- real apps through the loopback channel -----

def record_app(name: str, runs: int, tmp: Path) -> Recording:
    from rrto_plugins.torch.testing import loopback

    rec = Recording(name)
    itc = loopback(tmp / name)
    channel = itc.session.channel
    send, mark = channel.send, channel.mark
    current = [1]  # the inference whose calls are being sent

    def logged_send(frames: list[ops_pb2.SessionUp]) -> None:
        for f in frames:
            rec.events.append(("frame", ops_pb2.SessionUp.FromString(f.SerializeToString())))
            if f.WhichOneof("msg") == "call":
                rec.inference_of[f.call.seq] = current[0]
        send(frames)

    def logged_mark(index: int, start_ns: int, end_ns: int, **kw: Any) -> None:
        rec.events.append(("mark", index))
        mark(index, start_ns, end_ns, **kw)

    def pre(module: Any, args: Any) -> None:  # the outermost forward starts an inference
        if getattr(itc._tls, "depth", 0) == 1:
            current[0] = itc._index + 1

    channel.send, channel.mark = logged_send, logged_mark
    import torch.nn as nn

    hook = nn.modules.module.register_module_forward_pre_hook(pre)
    argv, path = sys.argv, list(sys.path)
    sys.argv, sys.path = [name, "--runs", str(runs)], [str(APPS), *sys.path]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(str(APPS / f"{name}.py"), run_name="__main__")
        itc.session.flush()
    finally:
        sys.argv, sys.path = argv, path
        hook.remove()
        itc.uninstall()
    return rec


# ----- synthetic logs -----

class Synth(ShimFrames):
    """Frames an app's shim would send for a model-shaped inference of ``period`` operators."""

    meta = ops_pb2.TensorMeta(dtype="float32", shape=[1, 64], stride=[64, 1], device="cpu")
    upload = b"\0" * 16

    def __init__(self, name: str, period: int):
        super().__init__()
        self.rec = Recording(name)
        self.period = period
        self.inference = 0
        self.bound: dict[str, int] = {}

    def record(self, frame: ops_pb2.SessionUp) -> None:
        self.rec.events.append(("frame", frame))
        if frame.WhichOneof("msg") == "call":
            self.rec.inference_of[frame.call.seq] = self.inference

    def op(self, op: str, *inputs: object, scalar: float = 0.0, out: int | None = None) -> int:
        """One call with one output (``out``: the id an in-place op wrote); returns its id."""
        return self.call(op, *inputs, scalar=scalar, out_ids=None if out is None else [out])[0]

    def weight(self, k: int) -> int:
        """A weight's id: bound by an ``alias`` of the persistent tensor on its first use."""
        name = f"w{k % 97}"
        if name not in self.bound:
            self.bound[name] = self.op("aten::alias", name.encode() * 4)
        return self.bound[name]

    def infer(self, grid: int, state: int | None = None) -> int | None:
        """One inference: ``period`` calls (weight binds of the first one excepted)."""
        self.inference += 1
        x = self.op("aten::conv2d", "img", self.weight(0))
        if state is not None:
            x = self.op("aten::gru_cell", x, state)  # reads the previous inference's state
            state = x
        n = self.period - 7 - (state is not None)
        for i in range(n):
            if i % 9 == 4:
                self.op("aten::relu_", x, out=x)  # in place: returns the id it wrote
            elif i % 9 == 7:
                x = self.op("aten::add.Tensor", x, grid)
            else:
                x = self.op(f"aten::op{i % 5}", x, self.weight(i + 1), scalar=float(i % 3))
        boxes = self.op("aten::linear", x, self.weight(1000))
        scores = self.op("aten::sigmoid", boxes)
        top = self.op("aten::topk", scores, scalar=10.0)
        self.rec.events.append(("mark", self.inference))  # the forward ends
        for v in (boxes, scores, top):  # the app reads each output: detach, then download
            self.fetch(self.op("aten::detach", v))
        return state

    @classmethod
    def steady(cls, calls: int, period: int) -> Recording:
        s = cls(f"synthetic {calls // 1000}k", period)
        grid = s.op("aten::arange", "n")  # built once, read by every inference
        while s.seq < calls:
            s.infer(grid)
        return s.rec

    @classmethod
    def carried(cls, calls: int, period: int) -> Recording:
        s = cls(f"carried-state {calls // 1000}k", period)
        grid = s.op("aten::arange", "n")
        state = s.op("aten::zeros", "shape")
        while s.seq < calls:
            state = s.infer(grid, state)
        s.rec.carried = True
        return s.rec


# ----- feeding a recorder -----

def replay_search(rec: Recording, search: str, budget: SearchBudget, truth: dict[str, Any],
                  tmp: Path) -> dict[str, Any]:
    """Frames into a Recorder; a due search runs at once. Stops when a sequence is found."""
    r = Recorder(f"{rec.name}.py", search, SEARCHES[search](), tmp / f"seq-{search}", budget)
    marks = searches = rejected = timed_out = 0
    seconds = 0.0
    out: dict[str, Any] = {"search": search, "found": False}
    for kind, f in rec.events:
        if kind == "mark":
            marks += 1
            continue
        if not r.observe(f):
            continue
        before = r.last_search
        t0 = time.perf_counter()
        d = r.search_now()
        seconds += time.perf_counter() - t0
        if r.last_search == before:
            continue  # not due after all (backoff)
        stat = r.search_stats[-1]
        searches += 1
        rejected += stat["rejected"]
        timed_out += bool(stat["timed_out"])
        if d is not None:
            (summary,) = r.sequences.values()
            start_seq = d.calls[0].seq
            right = summary["operators"] == truth["period"] and start_seq in truth["starts"]
            out.update(found=True, found_after=marks, replay_from=marks + 1 - truth["warmup"],
                       period=summary["operators"], found_at=summary["found_at"],
                       wrong=not right, last_search_ms=stat["seconds"] * 1e3,
                       log=stat["log"])
            break
    out.update(searches=searches, rejected=rejected, timed_out=timed_out,
               search_s=seconds, recorded=r.log.recorded, log_max=len(r.log))
    return out


def one_search(rec: Recording, search: str) -> dict[str, Any]:
    """One search of the whole log: entry building, then candidates and verification."""
    log = OpLog(max_calls=1 << 40)
    for kind, f in rec.events:
        if kind == "frame":
            log.record(f)
    t0 = time.perf_counter()
    entries = log.entries()
    t1 = time.perf_counter()
    outcome = search_log(entries, SEARCHES[search]())
    t2 = time.perf_counter()
    return {"log": len(entries), "entries_ms": (t1 - t0) * 1e3, "search_ms": (t2 - t1) * 1e3,
            "found": outcome.found is not None,
            "period": outcome.found.period if outcome.found else None,
            "rejected": outcome.rejected}


# ----- report -----

def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Sequence search: dds vs period",
        "",
        f"`{doc['command']}` — {doc['date']}, {doc['machine']}, {doc['seconds']:.0f} s.",
        "",
        "## Inferences until found (recorder fed frame by frame, default search budget)",
        "",
        "Warm-up: leading inferences whose operators differ from the steady state (the "
        "synthetic logs bind their weights during the first one). Found after: inferences "
        "completed when the search succeeded; replay can start with the next one, whose index "
        "among the steady-state inferences is 'replay from steady #'. Searches: searches run "
        "until then (one per download). Rejected: candidates proposed that verification "
        "refused (false positives), over all those searches. Wrong: accepted with a period or "
        "start other than the known truth.",
        "",
        "| log | ops/inference | warm-up | search | found after | replay from steady # | searches "
        "| rejected | wrong | search time, all searches (ms) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in doc["found"]:
        t = row["truth"]
        for r in row["results"]:
            found = r["found"]
            lines.append(
                f"| {row['log']} | {t['period']} | {t['warmup']} | {r['search']} | "
                f"{r['found_after'] if found else 'never'} | "
                f"{r['replay_from'] if found else '-'} | {r['searches']} | {r['rejected']} | "
                f"{('yes' if r['wrong'] else 'no') if found else '-'} | "
                f"{r['search_s'] * 1e3:.1f} |")
    lines += [
        "",
        "## Search time against log length (one search of the whole log)",
        "",
        "Entries: parsing the relayed frames into comparable calls (shared by both searches; "
        "the recorder does it incrementally). Search: candidates and their verification.",
        "",
        "| log | calls | entries (ms) | dds (ms) | dds rejected | period (ms) | period rejected |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in doc["timing"]:
        d, p = row["dds"], row["period"]
        lines.append(f"| {row['log']} | {d['log']} | {d['entries_ms']:.1f} | {d['search_ms']:.1f}"
                     f"{'' if d['found'] else ' (none)'} | {d['rejected']} | "
                     f"{p['search_ms']:.1f}{'' if p['found'] else ' (none)'} | {p['rejected']} |")
    b = doc["budget"]
    lines += [
        "",
        "## Search budget on logs where nothing can be found (state carried across inferences)",
        "",
        "Without a budget a search runs after every download on the growing log; with the "
        "default budget (`rrtod.robot.recorder.SearchBudget`) searches back off exponentially once "
        "failed searches have scanned its eager allowance.",
        "",
        "| log: budget | frames recorded | searches | entries scanned | search time (s) "
        "| log kept (calls) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in b["runs"].items():
        lines.append(f"| {name} | {r['recorded']} | {r['searches']} | {r['scanned']} | "
                     f"{r['search_s']:.2f} | {r['log_max']} |")
    if doc.get("daemon"):
        lines += [
            "",
            "## End to end: apps under rrto-run against rrtod (dds, default budget)",
            "",
            "found_at: inferences the daemon had seen when the search succeeded. Replayed: "
            "inferences the shim replayed out of those run; replay starts with inference "
            "runs − replayed + 1. Back to back, the app's next inference starts before the "
            "definition has reached the shim (search, then robot → host → robot → shim); its "
            "first call waits for the search the robot said is running (SearchHint).",
            "",
            "| app | pause after each inference (ms) | found_at | replayed | replay from inference "
            "| mismatches | search (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in doc["daemon"]:
            if r.get("rc"):
                lines.append(f"| {r['app']} | {r['pause_ms']:.0f} | failed: "
                             f"{r.get('error', '')[-80:]!r} | | | | |")
                continue
            rep = r["replays"] or 0
            lines.append(f"| {r['app']} | {r['pause_ms']:.0f} | "
                         f"{', '.join(map(str, r['found_at'])) or 'never'} | {rep}/{r['runs']} | "
                         f"{r['runs'] - rep + 1 if rep else '-'} | {r['mismatches']} | "
                         f"{', '.join(map(str, r['search_ms']))} |")
    return "\n".join(lines) + "\n"


def budget_runs(rec: Recording, big: Recording, tmp: Path) -> dict[str, Any]:
    runs = {}
    for name, budget, log in (("none (search at every download)",
                               SearchBudget(eager_work=1 << 62, time_s=60.0), rec),
                              ("default", SearchBudget(), rec),
                              ("default", SearchBudget(), big)):
        r = Recorder(f"{log.name}.py", name, DataDependencySearch(), tmp / "seq-budget", budget)
        searches, scanned, seconds = 0, 0, 0.0
        for kind, f in log.events:
            if kind == "frame" and r.observe(f):
                before = r.last_search
                t0 = time.perf_counter()
                r.search_now()
                seconds += time.perf_counter() - t0
                if r.last_search != before:
                    searches += 1
                    scanned += r.search_stats[-1]["log"]
        runs[f"{log.name}: {name}"] = {
            "recorded": r.log.recorded, "searches": searches, "scanned": scanned,
            "search_s": seconds, "log_max": len(r.log), "truncated": r.log.truncated}
    return {"log": rec.name, "runs": runs}


def daemon_runs(models: list[str], runs: int, pauses: list[float]) -> list[dict[str, Any]]:
    """Each app under rrto-run against a fresh rrtod: found_at (daemon), replays (shim)."""
    from testkit.daemons import Launcher

    out = []
    with Launcher() as launcher:
        d = launcher.start("rrtod", log={"format": "json", "level": "info"})
        for pause in pauses:
            for name in models:
                d.ctl("flush", "--all")
                for saved in (Path(d.config["state_dir"]) / "sequences").glob("*.json"):
                    saved.unlink()  # each run starts from nothing recorded
                env = app_env(**d.env, RRTO_STATS="1", RRTO_FALLBACK="error",
                              OMP_WAIT_POLICY="PASSIVE")
                cmd = [str(BIN / "rrto-run"), "--", sys.executable, "-c", PACED, str(APPS), name,
                       str(pause), str(runs)]
                row: dict[str, Any] = {"app": name, "pause_ms": pause * 1e3, "runs": runs}
                try:
                    p = subprocess.run(cmd, env=env, cwd=APPS, capture_output=True, text=True,
                                       timeout=120)
                    stats = shim_stats(p.stderr) or {}
                    seqs = d.ctl("sequences")["sequences"]
                    row.update(rc=p.returncode, replays=stats.get("replays"),
                               mismatches=stats.get("mismatches"),
                               found_at=[q.get("found_at") for q in seqs],
                               operators=[q.get("operators") for q in seqs],
                               search_ms=[round(q.get("search_s", 0) * 1e3, 2) for q in seqs])
                    if p.returncode:
                        row["error"] = p.stderr[-500:]
                except (subprocess.TimeoutExpired, RuntimeError, ValueError) as exc:
                    row.update(rc=-1, error=str(exc)[-500:])
                out.append(row)
                print(f"daemon {name} pause {pause * 1e3:.0f} ms: {row.get('found_at')} "
                      f"replays {row.get('replays')}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.search", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="inferences per app (default 6)")
    parser.add_argument("--models", default=",".join(MODELS + EXTRA))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-daemon", action="store_true",
                        help="skip the end-to-end runs against rrtod")
    parser.add_argument("--daemon-runs", type=int, default=8)
    parser.add_argument("--pause-ms", default="0,20",
                        help="pauses after each inference for the end-to-end runs")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rrto-bench-search-") as tmpdir:
        tmp = Path(tmpdir)
        recordings = []
        for name in args.models.split(","):
            t0 = time.perf_counter()
            recordings.append(record_app(name, args.runs, tmp))
            print(f"recorded {name}: {len(recordings[-1].calls())} calls "
                  f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        synthetic = [Synth.steady(1_000, 100), Synth.steady(10_000, 500),
                     Synth.steady(50_000, 2_000)]
        carried = Synth.carried(10_000, 100)
        carried_big = Synth.carried(120_000, 100)
        found, timing = [], []
        for rec in [*recordings, *synthetic]:
            truth = rec.truth()
            results = [replay_search(rec, s, SearchBudget(), truth, tmp) for s in SEARCHES]
            found.append({"log": rec.name, "truth": {k: v for k, v in truth.items() if k != "starts"},
                          "results": results})
            print(f"searched {rec.name}", file=sys.stderr, flush=True)
        real = [r for r in recordings if r.name == "gru"] or recordings[:1]
        for rec in [*real, *synthetic, carried]:
            timing.append({"log": rec.name, **{s: one_search(rec, s) for s in SEARCHES}})
        budget = budget_runs(carried, carried_big, tmp)
    models = [m for m in args.models.split(",") if m in MODELS]
    daemon = [] if args.no_daemon or not models else daemon_runs(
        models, args.daemon_runs, [float(p) / 1e3 for p in args.pause_ms.split(",")])
    given = sys.argv[1:] if argv is None else argv
    doc = {"command": " ".join([".venv/bin/python -m bench.search", *given]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python "
                      f"{platform.python_version()}",
           "seconds": time.perf_counter() - t_start,
           "found": found, "timing": timing, "budget": budget, "daemon": daemon}
    text = markdown(doc)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "search.md").write_text(text)
    (args.out / "search.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
