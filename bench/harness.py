"""Runs every model × link × system in one process tree and collects every sample.

Per link: a measurement server, the GPU daemon, the NTO server, the link proxy in front of all
three (so they share one emulated link), and one robot daemon per daemon system (per-op, rrto)
pointed at the proxy. Per cell: the link is measured first (a cell whose RTT or throughput
misses its target by more than 10% is refused: kept in the JSON with its samples, never reported
in the table; so is a scheduled cell whose placement changed during its measured window,
``placement_moved``), then the app runs as a subprocess; at the end of its warm-up and after its last
measured inference it pauses so the harness can snapshot the daemon's and the link's counters
(the first pause also restarts the bandwidth trace), so per-inference figures cover only the
measured inferences and every system sees the same trace. A failing cell is recorded with its
error and the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import stats
from bench.cpus import Split, pinned, robot_group
from bench.energy import RobotMeter
from bench.inputs import INPUTS_ENV
from bench.link import ALL_LINKS, LinkProcess, LinkSpec, MeasureServer, measure
from rrtod.config import PowerConfig
from rrtod.grpc_options import CHANNEL_OPTIONS, POLLING_EXPERIMENTS, SERVER_OPTIONS
from testkit.apps import shim_stats

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "bench" / "app.py"
BIN = Path(sys.executable).parent
SYSTEMS = ("local", "per-op", "nto", "rrto")
# rrto under another scheduler than the default remote-all (``rrto:<scheduler>``, its robot
# daemon's ``scheduler:``; ``+switch``: with ``switch_plans: true``; docs/scheduling.md): not
# part of the default run.
SCHEDULED = ("rrto:robot-all", "rrto:min-cut", "rrto:min-cut+switch", "rrto:hybrid-parallel")
# Systems whose outputs equal local's within float32 rounding, not bit for bit, by design
# (Hybrid-Parallel computes bands of a convolution, which the library may sum in another
# order: docs/scheduling.md): compared value by value within ``APPROX_RTOL``/``APPROX_ATOL``.
APPROXIMATE = ("rrto:hybrid-parallel",)
APPROX_RTOL, APPROX_ATOL = 1e-4, 1e-4
DAEMON_SYSTEMS = ("per-op", "rrto", *SCHEDULED)
# Mode overrides the shim reads from the environment (see plugins/torch and rrtod/shim).
# RRTO_FALLBACK=error: a shim that cannot reach its daemon must fail the cell, not quietly run
# the model locally and report local numbers as offloaded ones. RRTO_STATS=1 asks the shim for
# its own figures as one ``rrto-stats {json}`` line on stderr at exit (see parse_shim_stats).
_SHIM_ENV = {"RRTO_FALLBACK": "error", "RRTO_STATS": "1"}
MODE_ENV = {"per-op": {"RRTO_MODE": "sync", "RRTO_REPLAY": "0", **_SHIM_ENV},
            "rrto": {"RRTO_MODE": "stream", "RRTO_REPLAY": "1", **_SHIM_ENV}}
MODE_ENV.update({s: MODE_ENV["rrto"] for s in SCHEDULED})


def scheduler_of(system: str) -> str:
    """The robot daemon's ``scheduler:`` for a daemon system."""
    name = system.split(":", 1)[1] if system.startswith("rrto:") else "remote-all"
    return name.removesuffix("+switch")


def switches_plans(system: str) -> bool:
    """The robot daemon's ``switch_plans:`` for a daemon system."""
    return system.endswith("+switch")


# Set for every process of a run (apps, NTO server and client, daemons, link proxy) unless the
# caller set them, and recorded in the JSON:
# - OMP_WAIT_POLICY: several processes share 2 cores here, and libgomp's default active wait
#   keeps idle torch worker threads spinning, stealing the core from whichever process computes
#   (a 2 ms detector frame measured 93 ms beside one busy process; with PASSIVE, 2 ms).
# - GRPC_EXPERIMENTS: the gRPC engine the daemons choose for themselves (rrtod/grpc_options.py)
#   when nobody set it. Set here, every gRPC process of the run uses it, NTO's included: nto
#   alone measured 0.94 -> 0.71 ms (loopback mlp) with it, so leaving it to the daemons would
#   compare rrto with a slower reference.
PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GRPC_EXPERIMENTS": POLLING_EXPERIMENTS}
RECORDED_ENV = (*PROCESS_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class Plan:
    models: list[str]
    links: list[str]
    systems: list[str]
    iters: int = 30
    warmup: int = 5
    budget_s: float = 60.0  # measured part of one cell stops after this
    cell_timeout_s: float = 600.0  # the whole app process is killed after this
    quick: bool = False
    # Each (link, model)'s remote systems run this many times back to back (``--rounds``),
    # the order reversed every other round: ratios from cells seconds apart, not minutes.
    rounds: int = 1
    threads: int | None = None  # OMP_NUM_THREADS for every process (None: torch's default)
    cpus: Split | None = None  # robot side and host side pinned apart (bench/cpus.py)
    # The robot side (apps, robot daemons) in a cgroup with this many CPUs' worth of time
    # (``--robot-cpu``; bench/cpus.py): a robot slower than its host
    robot_cpu: float | None = None
    robot_cgroup: str | None = None  # that cgroup (set by ``run``)
    # Each model's weights put in the GPU daemon's cache over a direct route before a link's
    # cells (``--preload-weights``): the link then carries inferences only, as NTO's server
    # has its model already. Without it a slow link's first rrto cell uploads them.
    preload: bool = False
    # What each inference's input is (``--inputs``, ``bench.models.INPUTS``): "randn", or
    # "frames", 8-bit camera frames an app normalises before its model
    inputs: str = "randn"
    out_dir: Path = field(default_factory=lambda: REPO / "bench" / "results")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out_dir": str(self.out_dir),
                "cpus": self.cpus.to_dict() if self.cpus else None}


class CellError(Exception):
    pass


def _stderr_tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def parse_shim_stats(stderr: str) -> dict[str, Any] | None:
    """The shim's own figures, if it printed a ``rrto-stats {json}`` line on stderr (last wins).

    The target is the shim's time per *replayed* operator, so keys are used in this order:
    ``shim_us_per_op``; ``replay_shim_s`` / ``replay_timed`` (the calls the shim timed, a
    random share of those replayed; ``replayed_ops`` where it timed them all); ``shim_s`` /
    ``ops`` (every operator, record phase included: an upper bound). Also ``round_trips`` and
    ``inferences``.
    """
    found = shim_stats(stderr)
    if not isinstance(found, dict) or "shim_us_per_op" in found:
        return found
    timed = "replay_timed" if found.get("replay_timed") else "replayed_ops"
    for seconds, ops in (("replay_shim_s", timed), ("shim_s", "ops")):
        if found.get(ops) and seconds in found:
            found["shim_us_per_op"] = found[seconds] / found[ops] * 1e6
            found["shim_us_per_op_basis"] = ops
            break
    return found


class LinkEnv:
    """Everything one link needs, started in order and torn down in reverse (also on errors)."""

    def __init__(self, spec: LinkSpec, systems: list[str], stack: contextlib.ExitStack,
                 cpus: Split | None = None, robot_cgroup: str | None = None,
                 preload: list[str] | None = None):
        self.spec = spec
        robot_cpus, host_cpus = (cpus.robot, cpus.host) if cpus else (None, None)
        self.robots: dict[str, Any] = {}  # system -> its robot daemon
        self.gpu: Any = None
        self.nto_address: str | None = None
        self.link: LinkProcess | None = None
        self.daemon_error: str | None = None
        self.measure_server = MeasureServer()
        stack.callback(self.measure_server.close)
        targets: dict[str, str] = {"measure": self.measure_server.address}
        needs_daemons = any(s in DAEMON_SYSTEMS for s in systems)
        # Daemons and the NTO server start side by side (each imports torch: seconds): their
        # addresses are chosen before they start, so nothing waits for another's start-up.
        if needs_daemons:
            from testkit.daemons import Launcher

            self.launcher = stack.enter_context(Launcher())
            self.gpu = self.launcher.start("gpu", roles=["gpu"], wait=False,
                                           prefix=pinned([], host_cpus))
        if "nto" in systems:
            self.nto_proc = subprocess.Popen(pinned([sys.executable, "-m", "bench.nto", "serve"],
                                                    host_cpus),
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             text=True, cwd=str(REPO))
            stack.callback(_stop, self.nto_proc)
            assert self.nto_proc.stdout is not None
            line = self.nto_proc.stdout.readline().split()
            if line[:1] != ["READY"]:
                raise RuntimeError("NTO server did not start")
            targets["nto"] = f"127.0.0.1:{line[1]}"
        if self.gpu is not None:
            try:
                self.gpu.wait_notify("READY=1")
                targets["gpu"] = self.gpu.listen
            except Exception as e:  # noqa: BLE001 - recorded per cell, the run goes on
                self.daemon_error = f"GPU daemon did not start: {e}"
                self.gpu = None
        self.preloaded: dict[str, float] = {}
        if self.gpu is not None and preload:
            self.preloaded = self._preload(preload)
        names = list(targets)
        if spec.emulated:
            self.link = stack.enter_context(LinkProcess(spec, list(targets.values())))
            self.addresses = {n: self.link.address(i) for i, n in enumerate(names)}
            self.one_way_delay_s = self.link.calibrate(self.addresses["measure"])
        else:
            self.addresses = dict(targets)
            self.one_way_delay_s = 0.0
        self.nto_address = self.addresses.get("nto")
        # One robot daemon per daemon system, each with its own state dir, all on the same GPU
        # daemon and link: sequences that a per-op session recorded must not be restored into an
        # rrto session (the result would depend on the order of the cells).
        starting = {system: self.launcher.start(
                        f"robot-{system.replace(':', '-')}", roles=["robot"], wait=False,
                        prefix=pinned([], robot_cpus, robot_cgroup),
                        scheduler=scheduler_of(system), switch_plans=switches_plans(system),
                        hosts=[{"name": "gpu", "address": self.addresses["gpu"]}])
                    for system in DAEMON_SYSTEMS if system in systems and self.gpu is not None}
        for system, robot in starting.items():
            try:
                robot.wait_notify("READY=1")
                robot.wait_for(lambda s: s["hosts"] and s["hosts"][0]["state"] == "up",
                               timeout=30, what="GPU host up")
                self.robots[system] = robot
            except Exception as e:  # noqa: BLE001
                self.daemon_error = f"robot daemon for {system} not ready: {e}"

    def _preload(self, models: list[str]) -> dict[str, float]:
        """Run each model once (forwarded) through a robot daemon that reaches the GPU daemon
        directly, not through the link: its weights are then in the host's cache, which every
        later session finds by content hash. Seconds each took."""
        robot = self.launcher.start("robot-preload", roles=["robot"],
                                    hosts=[{"name": "gpu", "address": self.gpu.listen}])
        robot.wait_for(lambda s: s["hosts"] and s["hosts"][0]["state"] == "up", timeout=30,
                       what="GPU host up")
        took = {}
        for model in models:
            t0 = time.monotonic()
            out = subprocess.run([str(BIN / "rrto-run"), sys.executable, str(APP), "--model",
                                  model, "--iters", "1", "--warmup", "0"],
                                 env={**os.environ, **robot.env, **MODE_ENV["per-op"]},
                                 capture_output=True, text=True, timeout=600, cwd=str(REPO))
            if out.returncode != 0:
                raise RuntimeError(f"preloading {model}'s weights failed: "
                                   f"{_stderr_tail(out.stderr)}")
            took[model] = time.monotonic() - t0
        robot.stop()
        return took

    def measure(self) -> dict[str, Any]:
        return measure(self.addresses["measure"], self.spec, self.link).to_dict()


def _stop(proc: subprocess.Popen[Any], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _switches(warm: dict[str, Any] | None, done: dict[str, Any] | None,
              n: int) -> dict[str, float]:
    """Plan switches per inference between the two snapshots (the robot daemon's placer for
    the session: ``rrtod.robot.scheduling``); empty without a splitting scheduler."""
    def count(snap: dict[str, Any] | None) -> int | None:
        return ((snap or {}).get("scheduling") or {}).get("switches")

    before, after = count(warm), count(done)
    return {} if before is None or after is None else {"plan_switches": (after - before) / n}


def placement_moved(warm: dict[str, Any] | None, done: dict[str, Any] | None,
                    system: str) -> str | None:
    """Why a scheduled cell's window is not one placement's steady state: the plan of a
    sequence changed between the two snapshots (``SessionPlacer.describe``'s ``plans``) while
    the scheduler does not follow the link. ``min-cut`` and ``hybrid-parallel`` measure their
    candidate placements over their first inferences; a warm-up too short for them leaves
    that search in the measured window, whose figure is then a mix of placements (cnn on
    loopback, 10 inferences after 5: plan 0 -> 1 inside the window). None when nothing
    moved, or where plans may change by design (``+switch``)."""
    if system not in SCHEDULED or switches_plans(system):
        return None

    def plans(snap: dict[str, Any] | None) -> dict[str, int]:
        found = ((snap or {}).get("scheduling") or {}).get("plans") or {}
        return {str(k): v for k, v in found.items()}

    before, after = plans(warm), plans(done)
    moved = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    if not moved:
        return None
    return ("placement changed during the measured window (sequence "
            + ", ".join(f"{k}: plan {before[k]} -> {after[k]}" for k in moved)
            + "): a longer --warmup measures one placement")


def _host_replay(warm: dict[str, Any] | None, done: dict[str, Any] | None) -> dict[str, float]:
    """The GPU daemon's time per replayed inference between the two snapshots (its session's
    ``replay_cpu_s``, ``replay_wall_s`` and ``replay_minor_faults``, rrtod/gpu/replay.py): the
    replay thread's CPU for the calls, beside the NTO server's compute time of the same model;
    from each start frame to its last call; the page faults it took; the in-place calls it
    copied a value for (an abort's undo) and those it did not (the app had matched them); the
    host's operators its native loop ran (``native_calls``). Empty when no replay ran to its
    end in the window."""
    if not warm or not done:
        return {}
    n = done.get("replays_completed", 0) - warm.get("replays_completed", 0)
    if n <= 0:
        return {}
    out = {key: (done.get(field, 0.0) - warm.get(field, 0.0)) / n * 1e3
           for key, field in (("host_replay_cpu_ms", "replay_cpu_s"),
                              ("host_replay_ms", "replay_wall_s"))}
    if "replay_minor_faults" in done:  # page faults of the replay thread (fresh memory)
        out["host_replay_faults"] = (done["replay_minor_faults"]
                                     - warm.get("replay_minor_faults", 0)) / n
    if "replay_snapshots" in done:  # undo copies of in-place calls, and those not needed
        for key, field in (("host_snapshots", "replay_snapshots"),
                           ("host_snapshots_skipped", "replay_snapshots_skipped")):
            out[key] = (done[field] - warm.get(field, 0)) / n
    ops = done.get("ops", 0) - warm.get("ops", 0)
    if "native_calls" in done and ops > 0:  # the share the native loop ran (plugins/torch/batch)
        out["host_native_share"] = (done["native_calls"] - warm.get("native_calls", 0)) / ops
        out["host_native_calibrations"] = (done.get("native_calibrations", 0)
                                           - warm.get("native_calibrations", 0)) / n
    return out


def _live_session(status: dict[str, Any], pid: int) -> dict[str, Any] | None:
    sessions = status.get("sessions") or []
    for s in sessions:
        if s.get("pid") == pid:
            return s
    return sessions[-1] if sessions else None


STANDBY_W = PowerConfig().model["standby"]  # the model meter's floor (the RRTO paper's robot)
STANDBY_MARGIN = 0.9  # what the app times beyond the marks (see _energy_figures)
COUNTERS = ("ops_forwarded", "frames_up", "frames_down", "bytes_up", "bytes_down", "inferences")


def measured_deadline_s(budget_s: float, warmup_ms: list[float]) -> float:
    """How long the measured part may take before the app counts as stalled: its budget, plus
    the last inference that started before the budget ran out (at most 3× the slowest warm-up
    inference, which includes the record phase), plus 30 s of slack for exit and teardown."""
    return budget_s + 3 * max(warmup_ms or [0.0]) / 1e3 + 30.0


def run_app(cmd: list[str], env: dict[str, str], timeout: float,
            phases: dict[str, Any] | None = None, budget_s: float | None = None
            ) -> tuple[dict[str, Any], str, float]:
    """Run one app process; returns (its JSON result, its stderr, wall seconds).

    ``phases[name](pid)`` runs while the app waits after printing ``{"phase": name}``. The app is
    killed after ``timeout``, or sooner once its warm-up is over and it overruns
    ``measured_deadline_s`` (a hung offloaded call must not hold the run for the full timeout).
    """
    phases = phases or {}
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, cwd=str(REPO), env={**os.environ, **env})
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        result = None
        try:
            assert proc.stdout is not None and proc.stdin is not None
            for line in proc.stdout:
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    if isinstance(msg, dict) and "phase" in msg:
                        hook = phases.get(msg["phase"])
                        if hook is not None:
                            hook(proc.pid)
                        if msg["phase"] == "warm" and budget_s is not None:
                            left = timeout - (time.monotonic() - t0)
                            timer.cancel()
                            timer = threading.Timer(
                                min(left, measured_deadline_s(budget_s, msg.get("warmup_ms") or [])),
                                proc.kill)
                            timer.start()
                        proc.stdin.write("\n")
                        proc.stdin.flush()
                    elif isinstance(msg, dict) and "latency_ms" in msg:
                        result = msg
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    wall = time.monotonic() - t0
    if result is None:
        why = "killed: timed out or stalled" if proc.returncode == -9 else f"exit {proc.returncode}"
        raise CellError(f"app failed ({why}): {_stderr_tail(stderr)}")
    return result, stderr, wall


def _command(env: LinkEnv | None, model: str, system: str, plan: Plan) -> tuple[list[str], dict[str, str]]:
    """The process one cell runs (on the robot side's CPUs), and the environment it adds."""
    cmd, extra = _unpinned_command(env, model, system, plan)
    return pinned(cmd, plan.cpus.robot if plan.cpus else None, plan.robot_cgroup), extra


def _unpinned_command(env: LinkEnv | None, model: str, system: str,
                      plan: Plan) -> tuple[list[str], dict[str, str]]:
    app_args = ["--model", model, "--iters", str(plan.iters), "--warmup", str(plan.warmup),
                "--budget-s", str(plan.budget_s), "--sync", "--sync-end"]
    if system in APPROXIMATE or (system == "local" and set(plan.systems) & set(APPROXIMATE)):
        app_args += ["--values", str(values_file(model, system, env))]
    if system == "local":
        return [sys.executable, str(APP), *app_args], {}
    assert env is not None
    if system == "nto":
        assert env.nto_address
        return [sys.executable, "-m", "bench.nto", "client", "--target", env.nto_address, *app_args], {}
    robot = env.robots.get(system)
    if robot is None:
        raise CellError(env.daemon_error or "robot daemon not running")
    run = BIN / "rrto-run"
    if not run.exists():
        raise CellError("rrto-run is not installed yet (the shim is pending)")
    return [str(run), sys.executable, str(APP), *app_args], {**robot.env, **MODE_ENV[system]}


def _replays(session: dict[str, Any] | None) -> int:
    """Inferences the robot daemon saw start as replays: its session's count, which keeps
    those of a sequence another replaced (Mask R-CNN's, as it learns loop variants: summing
    the listed sequences said 30% of a window every inference of which replayed); the listed
    sequences' sum from a daemon that reports no count."""
    record = (session or {}).get("record") or {}
    if "replays" in record:
        return int(record["replays"])
    return sum(int(s.get("replays") or 0) for s in record.get("sequences") or [])


def run_cell(env: LinkEnv | None, model: str, system: str, plan: Plan) -> dict[str, Any]:
    cell: dict[str, Any] = {"link": env.spec.name if env else None, "model": model, "system": system,
                            "status": "ok", "error": None}
    snaps: dict[str, dict[str, Any]] = {"warm": {}, "done": {}}
    daemon = system in DAEMON_SYSTEMS
    try:
        cmd, extra_env = _command(env, model, system, plan)
        if env is not None and system != "local":
            cell["link_measurement"] = env.measure()
            if not cell["link_measurement"]["valid"]:
                cell["status"] = "refused"
                cell["error"] = "; ".join(cell["link_measurement"]["problems"])
        robot = env.robots.get(system) if env is not None else None
        before = robot.ctl("status") if daemon and robot is not None else None

        # NTO and local: the robot's meter around the app (bench/energy.py), as the robot
        # daemon's accountant meters an offloading app
        meter: list[Any] = []

        def snapshot(phase: str, pid: int) -> None:
            """Counters at the end of the warm-up and after the last measured inference."""
            snaps[phase]["t"] = time.monotonic()
            if system in ("nto", "local"):
                if phase == "warm":
                    meter.append(RobotMeter(pid))
                elif meter:
                    meter[0].stop()
            if env is None or system == "local":
                return
            snap = snaps[phase]
            if daemon and robot is not None:
                status = robot.ctl("status")
                snap["session"] = _live_session(status, pid)
                sid = (snap["session"] or {}).get("id")
                snap["power"] = ((status.get("power") or {}).get("sessions") or {}).get(sid)
                if env.gpu is not None:  # the host's side of each replayed inference
                    snap["host"] = _live_session(env.gpu.ctl("status").get("gpu") or {}, pid)
            if env.link is not None:
                snap["link_bytes"] = env.link.carried()
                if phase == "warm":  # every system sees the trace from its start
                    snap["origin"] = env.link.reset_origin()

        try:
            result, stderr, wall = run_app(cmd, extra_env, plan.cell_timeout_s,
                                           {"warm": lambda pid: snapshot("warm", pid),
                                            "done": lambda pid: snapshot("done", pid)},
                                           plan.budget_s)
        finally:
            for m in meter:
                m.stop()  # also when the app failed before its last pause
        n = max(result["iters"], 1)
        cell.update(samples={k: result[k] for k in ("latency_ms", "cpu_ms", "warmup_ms")},
                    iters=result["iters"], warmup=result["warmup"], digests=result["digests"],
                    wall_s=wall, latency=stats.summarize(result["latency_ms"]),
                    cpu_ms_per_inference=stats.summarize(result["cpu_ms"])["median"])
        warm, done = snaps["warm"], snaps["done"]
        mean_s = cell["latency"]["mean"] / 1e3
        if "t" in warm and "t" in done:
            cell["window_s"] = done["t"] - warm["t"]
            if env is not None and env.link is not None and env.link.trace is not None:
                # the trace restarted at the warm snapshot: its mean over the measured window
                cell["window_mbps"] = env.link.expected_mbps(warm.get("origin", warm["t"]),
                                                             done["t"])
        per_inf: dict[str, Any] = {}
        if "link_bytes" in warm and "link_bytes" in done:
            per_inf["link_bytes_up"] = (done["link_bytes"][0] - warm["link_bytes"][0]) / n
            per_inf["link_bytes_down"] = (done["link_bytes"][1] - warm["link_bytes"][1]) / n
        if system == "nto":
            cell["host_compute_ms"] = stats.summarize(result.get("host_compute_ms") or [])["median"]
            per_inf.update(round_trips=result["round_trips_per_inference"],
                           bytes_up=result["bytes_up_per_inference"],
                           bytes_down=result["bytes_down_per_inference"])
        if meter:
            cell["power_meter"] = meter[0].name
            session = meter[0].per_inference([tuple(s) for s in result["spans_ns"]])
            per_inf.update(_energy_figures(meter[0].name, session.get("energy_per_inference_j"),
                                           session.get("mean_inference_s"), mean_s))
        if before is not None and robot is not None:
            after = robot.wait_for(lambda s: not s["sessions"], timeout=30, what="session end")
            totals = {k: after["finished"][k] - before["finished"][k] for k in COUNTERS}
            if totals["ops_forwarded"] == 0:
                raise CellError("the app ran but forwarded no operator: not offloaded")
            at_warm = warm.get("session") or {}
            at_done = done.get("session") or totals  # fallback: the whole session's totals
            steady = {k: at_done.get(k, 0) - at_warm.get(k, 0) for k in COUNTERS}
            per_inf.update({k: v / n for k, v in steady.items() if k != "inferences"})
            per_inf["daemon_replies"] = per_inf["frames_down"]  # frames to the app, beside
            per_inf["daemon_inferences"] = steady["inferences"]
            per_inf["replayed"] = (_replays(done.get("session")) - _replays(at_warm)) / n
            per_inf.update(_host_replay(warm.get("host"), done.get("host")))
            per_inf.update(_switches(at_warm, done.get("session"), n))
            moved = placement_moved(at_warm, done.get("session"), system)
            if moved is not None and cell["status"] == "ok":
                cell.update(status="refused", error=moved)
            per_inf["record"] = (done.get("session") or at_warm).get("record")
            sid = at_warm.get("id")
            # A mark reaches the daemon with the app's next write: between the two snapshots it
            # received the marks of the last warm-up inference and of all measured ones but the
            # last, as many as were measured.
            end = done.get("power") or ((after.get("power") or {}).get("sessions") or {}).get(sid)
            cell["power_meter"] = (after.get("power") or {}).get("meter")
            # the app's latencies of the inferences whose marks are in that bucket
            bucket_ms = result["warmup_ms"][-1:] + result["latency_ms"][:-1]
            per_inf.update(_energy_figures(cell["power_meter"],
                                           *_energy_per_inference(warm.get("power"), end),
                                           sum(bucket_ms) / len(bucket_ms) / 1e3))
        shim = parse_shim_stats(stderr)
        if shim:
            cell["shim"] = shim
            window = shim_window(shim, result["warmup"], result["iters"])
            if window is not None:
                cell["shim_by_inference"] = window
                per_inf["round_trips"] = sum(window.get("round_trips") or [0]) / n
                per_inf["push_waits"] = sum(window.get("push_waits") or [0]) / n
        cell["per_inference"] = per_inf
    except CellError as e:
        cell.update(status="failed", error=str(e))
    except Exception as e:  # noqa: BLE001 - one broken cell must not end the run
        cell.update(status="failed", error=f"{type(e).__name__}: {e}")
    return cell


def shim_window(shim: dict[str, Any], warmup: int, iters: int) -> dict[str, list[int]] | None:
    """The shim's per-inference counts (``by_inference``: round trips, push waits, replays) of
    the measured inferences: the app's last ``iters`` (the shim numbers its outermost module
    calls from 1, ``inferences`` of them; a library's ``predict()`` makes some of its own
    before the app's first: Ultralytics' set-up made yolov8n's first 20 numbers the 23
    calls before the measured ones, 2.3 round trips an inference where they replay with
    one). None when the shim did not report every one of them."""
    by = shim.get("by_inference") or {}
    index = by.get("index") or []
    last = shim.get("inferences") or warmup + iters
    wanted = range(last - iters + 1, last + 1)
    at = {i: k for k, i in enumerate(index)}
    if not iters or any(i not in at for i in wanted):
        return None
    return {key: [values[at[i]] for i in wanted] for key, values in by.items()
            if key != "index" and isinstance(values, list) and len(values) == len(index)}


def _energy_per_inference(warm: dict[str, Any] | None, end: dict[str, Any] | None
                          ) -> tuple[float | None, float | None]:
    """(joules, seconds) per measured inference from the daemon's accountant: its totals at the
    end less those at the end of the warm-up (None, None when it has none)."""
    if not end or not end.get("inferences") or end.get("energy_per_inference_j") is None:
        return None, None

    def totals(s: dict[str, Any]) -> tuple[int, float, float]:
        return (s["inferences"], s["energy_per_inference_j"] * s["inferences"],
                (s.get("mean_inference_s") or 0.0) * s["inferences"])
    n, joules, seconds = totals(end)
    if warm and warm.get("inferences") and warm.get("energy_per_inference_j") is not None:
        wn, wj, ws = totals(warm)
        if n - wn > 0:
            n, joules, seconds = n - wn, joules - wj, seconds - ws
    return joules / n, (seconds / n if seconds > 0 else None)


def _energy_figures(meter: str | None, joules: float | None, span_s: float | None,
                    latency_s: float) -> dict[str, Any]:
    """Energy per inference, the marks' mean span, and the robot's mean power over an inference
    as the app timed it (energy / mean latency). The model meter's robot never draws less than
    its standby power (4.04 W in the RRTO paper): a figure below that means the energy missed
    part of the inference (as it did when marks ended with ``forward()``: 1.0-1.6 W), and is
    flagged. The app's timing also covers a little the marks cannot (its own calls around the
    model, ~0.1 ms, 5% of a 2 ms inference), hence the margin."""
    out: dict[str, Any] = {"energy_j": joules, "energy_span_s": span_s}
    if joules is not None and latency_s > 0:
        out["robot_power_w"] = joules / latency_s
        if meter == "model":
            out["power_below_standby"] = out["robot_power_w"] < STANDBY_MARGIN * STANDBY_W
    return out


def machine() -> dict[str, Any]:
    import platform
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "versions": {d: version(d) for d in ("torch", "grpcio", "rrtod", "numpy")},
            "git_commit": commit.stdout.strip() or None}


def window_rates(cell: dict[str, Any], spec: LinkSpec) -> tuple[float | None, float | None]:
    """The link's rate (up, down) over the cell's measured window: a trace link's mean over the
    window (the trace restarts when it begins), a fixed-rate link's rate; on an unlimited link,
    what the bulk transfers measured."""
    if spec.trace:
        rate = cell.get("window_mbps")
        if rate:
            return rate, rate
    elif spec.mbps:
        return spec.mbps, spec.mbps
    m = cell.get("link_measurement") or {}
    return m.get("up_mbps"), m.get("down_mbps")


def values_file(model: str, system: str, env: LinkEnv | None) -> Path:
    """Where an app of an ``APPROXIMATE`` comparison writes its outputs' values."""
    link = env.spec.name if env is not None and system != "local" else "local"
    VALUES_DIR.mkdir(exist_ok=True)
    return VALUES_DIR / f"{model}-{system.replace(':', '_')}-{link}.f64"


VALUES_DIR = Path(tempfile.gettempdir()) / f"rrto-bench-values-{os.getpid()}"


def _values_differ(model: str, c: dict[str, Any]) -> tuple[int, float] | None:
    """For an ``APPROXIMATE`` cell: (inferences whose values differ from local's beyond the
    tolerance, the largest difference), None if the values are not there to compare."""
    import numpy as np

    try:
        got = np.fromfile(VALUES_DIR / f"{model}-{c['system'].replace(':', '_')}-{c['link']}.f64")
        want = np.fromfile(VALUES_DIR / f"{model}-local-local.f64")
    except OSError:
        return None
    n = min(len(got), len(want))
    per = n // max(len(c.get("digests") or [1]), 1)
    if n == 0 or per == 0:
        return None
    diff = np.abs(got[:n] - want[:n])
    bad = diff > APPROX_ATOL + APPROX_RTOL * np.abs(want[:n])
    return int(bad.reshape(-1, per).any(axis=1).sum()) if n % per == 0 else int(bad.any()), \
        float(diff.max())


def check_outputs(cells: list[dict[str, Any]]) -> None:
    """Compare every inference's output digest (warm-up and measured) with local's for the
    same inference; a cell with any difference has failed, whatever its speed. An
    ``APPROXIMATE`` system's are compared value by value within the tolerance instead (and
    its digests' differences recorded, ``outputs_bit_exact``)."""
    local = {c["model"]: c.get("digests") for c in cells
             if c["system"] == "local" and c.get("digests")}
    for c in cells:
        want, got = local.get(c["model"]), c.get("digests")
        if c["system"] == "local" or got is None or want is None:
            continue
        if c["system"] in APPROXIMATE:
            compared = min(len(want), len(got))
            c["outputs_compared"] = compared
            c["outputs_bit_exact"] = sum(want[i] == got[i] for i in range(compared))
            differ = _values_differ(c["model"], c)
            if differ is None:
                c["status"], c["error"] = "failed", "output values missing for the comparison"
                continue
            c["output_max_abs_diff"] = differ[1]
            c["outputs_match_local"] = not differ[0]
            if differ[0]:
                c["status"] = "failed"
                c["error"] = (f"outputs differ from local's beyond rtol {APPROX_RTOL} atol "
                              f"{APPROX_ATOL} at {differ[0]} of {compared} inferences "
                              f"(up to {differ[1]:.3g})")
            continue
        compared = min(len(want), len(got))
        bad = [i for i in range(compared) if want[i] != got[i]]
        c["outputs_compared"] = compared
        c["outputs_unchecked"] = len(got) - compared  # local ran fewer (its budget ran out)
        c["output_mismatches"] = bad
        c["outputs_match_local"] = not bad
        if bad:
            c["status"] = "failed"
            first = bad[0] - c.get("warmup", 0)
            c["error"] = (f"outputs differ from local's at {len(bad)} of {compared} inferences, "
                          f"first at inference {bad[0]} "
                          + (f"(warm-up {bad[0]})" if first < 0 else f"(measured {first})")
                          + (f"; previous error: {c['error']}" if c.get("error") else ""))


def finish_cells(cells: list[dict[str, Any]], links: dict[str, Any]) -> list[dict[str, Any]]:
    """Add each cell's physical limit and compare systems per (link, model).

    Host compute is the NTO server's own compute time in the same link's run (measured on the
    host side, under that run's load), else the local median.
    """
    local = {c["model"]: c["latency"]["median"] for c in cells
             if c["system"] == "local" and c["status"] == "ok"}
    host = {(c["link"], c["model"]): c["host_compute_ms"] for c in cells
            if c["system"] == "nto" and c["status"] == "ok" and c.get("host_compute_ms") is not None
            and not math.isnan(c["host_compute_ms"])}
    for c in cells:
        m = c.get("link_measurement")
        compute = host.get((c["link"], c["model"]), local.get(c["model"]))
        if c["status"] != "ok" or not m or compute is None:
            continue
        pi = c.get("per_inference", {})
        up = pi.get("link_bytes_up", pi.get("bytes_up", 0.0))
        down = pi.get("link_bytes_down", pi.get("bytes_down", 0.0))
        up_rate, down_rate = window_rates(c, ALL_LINKS[c["link"]])
        c["limit_ms"] = stats.physical_limit_ms(m["rtt_ms"], up_rate, down_rate, up, down, compute)
        c["limit_rates_mbps"] = [up_rate, down_rate]
        # A bound the cell beat is no bound: shown flagged, never silently.
        c["limit_above_median"] = (c["limit_ms"] is not None
                                   and c["limit_ms"] > c["latency"]["median"])
    comps = []
    for link in links:
        for model in dict.fromkeys(c["model"] for c in cells):
            rounds = sorted({c.get("round", 0) for c in cells
                             if c["model"] == model and c["link"] == link}) or [0]
            per_round: list[dict[str, float | None]] = []
            shims: list[float] = []
            basis = None
            for r in rounds:
                medians: dict[str, float | None] = {}
                for c in cells:
                    if c["model"] != model or c["status"] != "ok":
                        continue
                    if c["system"] == "local" or (c["link"] == link and c.get("round", 0) == r):
                        medians[c["system"]] = c["latency"]["median"]
                        if c["system"] == "rrto":
                            shim = c.get("shim") or {}
                            if shim.get("shim_us_per_op") is not None:
                                shims.append(shim["shim_us_per_op"])
                            basis = shim.get("shim_us_per_op_basis")
                per_round.append(medians)
            shim_us = stats.percentile(shims, 50) if shims else None
            # Time over all operators includes host waits and the record phase: an upper bound
            # shown in the table, not a figure the target can be judged on.
            judged = None if basis == "ops" else shim_us
            robot = ALL_LINKS[link].emulated
            if len(per_round) == 1:
                medians = per_round[0]
                comp = stats.comparisons(medians, robot, judged)
            else:  # each system's median over the rounds; the ratios are the rounds' own
                systems = dict.fromkeys(k for m in per_round for k in m)
                medians = {k: stats.percentile([v for m in per_round
                                                if (v := m.get(k)) is not None], 50)
                           for k in systems}
                comp = stats.over_rounds([stats.comparisons(m, robot) for m in per_round],
                                         robot, judged)
            comps.append({"link": link, "model": model, "medians_ms": medians,
                          "shim_us_per_op": shim_us, "shim_us_per_op_basis": basis, **comp})
    return comps


def run(plan: Plan, log: Any = print) -> dict[str, Any]:
    """The whole benchmark; returns the results document (also what gets written as JSON).
    With ``plan.robot_cpu`` the robot side runs in a CPU-quota cgroup made for the run
    (``bench.cpus.robot_group``: OSError without the cgroup v1 cpu controller or root)."""
    if plan.robot_cpu is None:
        return _run(plan, log)
    with robot_group(plan.robot_cpu) as group:
        plan.robot_cgroup = group
        return _run(plan, log)


def _run(plan: Plan, log: Any) -> dict[str, Any]:
    started = time.time()
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    if plan.threads:
        os.environ["OMP_NUM_THREADS"] = str(plan.threads)
    os.environ[INPUTS_ENV] = plan.inputs  # (the apps and NTO's clients make their inputs)
    process_env = {k: os.environ.get(k) for k in RECORDED_ENV}
    cells: list[dict[str, Any]] = []
    links: dict[str, Any] = {}
    if "local" in plan.systems:
        for model in plan.models:
            cell = run_cell(None, model, "local", plan)
            log(_line(cell))
            cells.append(cell)
    remote = [s for s in plan.systems if s != "local"]
    for link_name in plan.links:
        spec = ALL_LINKS[link_name]
        info: dict[str, Any] = {"spec": asdict(spec)}
        links[link_name] = info
        if not remote:
            continue
        with contextlib.ExitStack() as stack:
            try:
                env = LinkEnv(spec, remote, stack, plan.cpus, plan.robot_cgroup,
                              plan.models if plan.preload else None)
            except Exception as e:  # noqa: BLE001
                info["error"] = f"{type(e).__name__}: {e}"
                log(f"[{link_name}] could not set up: {info['error']}")
                for model in plan.models:
                    for system in remote:
                        cells.append({"link": link_name, "model": model, "system": system,
                                      "status": "failed", "error": info["error"]})
                continue
            info.update(one_way_delay_s=env.one_way_delay_s, daemon_error=env.daemon_error,
                        measured_at_start=env.measure(), weights_preloaded_s=env.preloaded)
            if env.link and env.link.trace:
                info["trace_mean_mbps"] = env.link.trace.overall_mean_mbps()
            log(f"[{link_name}] link measured: {_fmt_measure(info['measured_at_start'])}")
            for model in plan.models:
                for r in range(plan.rounds):  # ABBA: a steady drift cancels in the pairs
                    for system in remote if r % 2 == 0 else remote[::-1]:
                        cell = run_cell(env, model, system, plan)
                        if plan.rounds > 1:
                            cell["round"] = r
                        log(_line(cell))
                        cells.append(cell)
    check_outputs(cells)
    comps = finish_cells(cells, links)
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "duration_s": time.time() - started, "machine": machine(), "plan": plan.to_dict(),
            "process_env": process_env,
            "grpc_options": {"nto_server": SERVER_OPTIONS, "nto_channel": CHANNEL_OPTIONS,
                             "daemons": "rrtod/grpc_options.py (the same lists)"},
            "links": links, "cells": cells, "comparisons": comps}


def _fmt_measure(m: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3g}"
    return (f"RTT {f(m['rtt_ms'])} ms (target {f(m['target_rtt_ms'])}), up {f(m['up_mbps'])} Mbit/s "
            f"(target {f(m['target_up_mbps'])}), down {f(m['down_mbps'])} Mbit/s"
            + ("" if m["valid"] else "  INVALID: " + "; ".join(m["problems"])))


def _line(cell: dict[str, Any]) -> str:
    where = f"{cell['link'] or '-'}/{cell['model']}/{cell['system']}"
    if cell["status"] == "failed":
        return f"  {where}: FAILED {cell['error'].splitlines()[0] if cell['error'] else ''}"
    lat = cell["latency"]
    tail = "" if cell["status"] == "ok" else f"  REFUSED ({cell['error']})"
    return f"  {where}: median {lat['median']:.2f} ms, p90 {lat['p90']:.2f} ms, n={lat['n']}{tail}"
