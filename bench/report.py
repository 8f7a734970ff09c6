"""Writes a run's results: the JSON document (every sample), a markdown table and a PNG plot.

Only cells with status ``ok`` count in the ratios; refused cells (link emulation off target) and
failed cells are listed below the table with their reason, and kept in the JSON. A cell whose
outputs differ from local execution on any inference has failed, and shows so wherever its
latency would be read: its row in the table says FAILED, the README block shows it instead of
its median, and the plot draws its bar hatched in red with a cross.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.link import ALL_LINKS
from bench.stats import percentile


def _f(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _kb(x: float | None) -> str:
    return "–" if x is None else _f(x / 1e3)


def wrong_outputs(cell: dict[str, Any]) -> bool:
    """A cell that ran but whose outputs differ from local's on some inference."""
    return cell.get("outputs_match_local") is False and "latency" in cell


def _outputs(cell: dict[str, Any]) -> str:
    if cell.get("outputs_match_local") is None:
        return "–"
    n = cell.get("outputs_compared")
    if cell["outputs_match_local"]:
        return f"yes ({n})" if n else "yes"
    return f"**NO: {len(cell.get('output_mismatches') or [])} of {n} differ**"


def _host_ms(cell: dict[str, Any]) -> str:
    """The host's time per inference: the NTO server's compute, or the GPU daemon's replay
    thread CPU per replayed inference (``bench.harness._host_replay``)."""
    if cell["system"] == "nto":
        return _f(cell.get("host_compute_ms"))
    pi = cell.get("per_inference", {})
    notes = []
    if pi.get("host_replay_faults") is not None:
        notes.append(f"{pi['host_replay_faults']:.0f} pf")
    if pi.get("host_native_share") is not None:
        notes.append(f"{pi['host_native_share']:.0%} native")
    return _f(pi.get("host_replay_cpu_ms")) + (f" ({', '.join(notes)})" if notes else "")


def energy_label(doc: dict[str, Any]) -> str:
    """What the energy figures are: the model meter's are modelled, not measured."""
    meters = {c.get("power_meter") for c in doc["cells"] if c.get("power_meter")}
    if meters == {"model"}:
        return "modelled (RRTO paper's robot)"
    return "meter " + ", ".join(sorted(m for m in meters if m)) if meters else "no meter"


def _energy(pi: dict[str, Any]) -> str:
    text = _f(pi.get("energy_j"))
    if pi.get("power_below_standby"):
        text += " ⚠"
    return text


def _cpus_line(plan: dict[str, Any], m: dict[str, Any]) -> str:
    cpus = plan.get("cpus")
    if cpus:
        return (f"Robot side (apps, robot daemons) pinned to CPU {_ints(cpus['robot'])}, host side "
                f"(GPU daemon, NTO server) to CPU {_ints(cpus['host'])} (`--split-cpus`): each "
                "side computes on its own cores, as two machines would; local runs on the robot "
                "side's. The host is no faster than the robot here: read offloading's cost (the "
                "ratios), not a speed-up.")
    return (f"The \"GPU host\" computes on the same {m['cpu_count']}-CPU machine as the robot app "
            "(no `--split-cpus`), so host compute is not faster than local here and the app's own "
            "CPU work slows it: read offloading's cost (the ratios), not a speed-up.")


def _ints(xs: list[int]) -> str:
    return ",".join(map(str, xs))


def markdown(doc: dict[str, Any], json_name: str | None = None) -> str:
    m = doc["machine"]
    plan = doc["plan"]
    out = [f"# rrtod benchmark — {doc['started']}", "",
           f"{m['platform']}, {m['cpu_count']} CPUs, torch {m['versions']['torch']}, "
           f"grpcio {m['versions']['grpcio']}, rrtod {m['versions']['rrtod']} "
           f"(commit {str(m.get('git_commit'))[:10]}). "
           f"{'Quick' if plan['quick'] else 'Full'} run: {plan['iters']} measured inferences after "
           f"{plan['warmup']} warm-up, at most {plan['budget_s']:g} s per cell; batch 1. "
           f"Run took {doc['duration_s']:.0f} s." + (f" Samples: `{json_name}`." if json_name else "")
           + " Every process ran with " + (", ".join(f"{k}={v}" for k, v in
                                                   (doc.get("process_env") or {}).items() if v) or "defaults")
           + ".",
           "", _cpus_line(plan, m), ""]
    out += ["## Links (measured through the emulator at the start of each link)", "",
            "| link | RTT target | RTT measured | rate target (Mbit/s) | up measured | down measured | "
            "cells refused |", "|---|---|---|---|---|---|---|"]
    for name, info in doc["links"].items():
        spec = ALL_LINKS[name]
        ms = info.get("measured_at_start") or {}
        refused = sum(1 for c in doc["cells"] if c["link"] == name and c["status"] == "refused")
        rate = (_f(spec.mbps) if spec.mbps else
                f"trace, mean {_f(info.get('trace_mean_mbps'))}" if spec.trace else "unlimited")
        out.append(f"| {name} | {_f(spec.rtt_ms or None)} ms | {_f(ms.get('rtt_ms'))} ms | {rate} | "
                   f"{_f(ms.get('up_mbps'))} | {_f(ms.get('down_mbps'))} | {refused} |")
    out += ["", "Each remote cell also measured its link right before it ran (in the JSON). Trace "
            "links compare measured throughput with the trace's mean over the same window.", ""]
    out += ["## Latency per inference", "",
            "| link | model | system | median ms | p90 ms | p99 ms | n | round trips (app / daemon) "
            f"| KB up | KB down | energy J, {energy_label(doc)} | robot W | client CPU ms | host ms "
            "| replayed | limit ms | outputs = local |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["cells"]:
        if c["status"] != "ok" and not wrong_outputs(c):
            continue
        pi = c.get("per_inference", {})
        lat = c["latency"]
        up = pi.get("link_bytes_up", pi.get("bytes_up"))
        down = pi.get("link_bytes_down", pi.get("bytes_down"))
        system = c["system"] + (f" #{c['round'] + 1}" if "round" in c else "")
        system += "" if c["status"] == "ok" else " **FAILED**"
        trips = _f(pi.get("round_trips"))
        if pi.get("daemon_replies") is not None:
            trips += f" / {_f(pi['daemon_replies'])}"
        limit = _f(c.get("limit_ms")) + (" !" if c.get("limit_above_median") else "")
        out.append(f"| {c['link'] or '(none)'} | {c['model']} | {system} | {_f(lat['median'])} | "
                   f"{_f(lat['p90'])} | {_f(lat['p99'])} | {lat['n']} | {trips} | "
                   f"{_kb(up)} | {_kb(down)} | {_energy(pi)} | {_f(pi.get('robot_power_w'))} | "
                   f"{_f(c.get('cpu_ms_per_inference'))} | {_host_ms(c)} | {_pct(pi.get('replayed'))} | "
                   f"{limit} | {_outputs(c)} |")
    out += ["", "Bytes are what the emulated link carried per measured inference (gRPC framing included);"
            " on loopback, what the app or daemon counted. Round trips, over the measured inferences "
            "only: 1 per call for NTO; for per-op/rrto the replies the app waited for as the shim "
            "counted them (a replayed inference's pushed outputs are one), then the robot daemon's "
            "frames to the app per inference. Host ms: for NTO its server's compute per inference; "
            "for rrto the GPU daemon's replay thread's CPU per replayed inference (operators and "
            "the Python around them: beside NTO's compute, what replay adds on the host), and in "
            "brackets the minor page faults it took (pf: memory touched afresh) and the share of "
            "its operators the native loop ran (native; the rest ran one by one in Python). "
            "Replayed: share of measured inferences the daemon saw "
            "replayed (record/replay active). Energy: the robot's energy per measured inference from "
            "its call to the app's last read of its outputs, by the robot daemon's power meter "
            "(per-op, rrto) or the same meter run by the harness around the NTO client; robot W is "
            "that energy over the app's mean latency, and ⚠ marks a figure below the model's standby "
            "power (a span that missed part of the inference). Limit: measured RTT + these bytes at "
            "the link's rate over the measured window (a trace's mean over it) + host compute (the "
            "NTO server's own compute time in the same link's run; else the local median); \"!\" "
            "marks a limit above the cell's median, which is then no bound. Outputs = local: every "
            "inference's outputs (warm-up and measured, how many in brackets) equal local "
            "execution's.", ""]
    out += ["## Ratios and targets (medians, same run)", "",
            "| link | model | rrto/nto | per-op/rrto | penalty removed | shim µs/op | targets |",
            "|---|---|---|---|---|---|---|"]
    for comp in doc["comparisons"]:
        if comp["link"] and not any(c["link"] == comp["link"] and c["model"] == comp["model"]
                                    for c in doc["cells"]):
            continue
        t = comp["targets"]
        met = ", ".join(f"{k} {'met' if v else 'MISSED' if v is not None else 'n/a'}" for k, v in t.items())
        bound = "≤" if comp.get("shim_us_per_op_basis") == "ops" else ""
        rounds = [r for r in comp.get("rrto_over_nto_rounds") or () if r is not None]
        spread = (f" ({_f(min(rounds))}–{_f(max(rounds))}, {len(rounds)} rounds)"
                  if len(rounds) > 1 else "")
        out.append(f"| {comp['link']} | {comp['model']} | {_f(comp['rrto_over_nto'])}{spread} | "
                   f"{_f(comp['per_op_over_rrto'])} | {_f(comp['penalty_removed'])} | "
                   f"{bound}{_f(comp.get('shim_us_per_op'))} | {met} |")
    out += ["", "Shim µs/op: the shim's own time per replayed operator; \"≤\" marks time over all operators "
            "with host waits included (an upper bound the target is not judged on). With rounds "
            "(`--rounds`, cells \"#k\"), each ratio is the median of the rounds' own ratios (each "
            "round's cells ran back to back), their range in brackets.", ""]
    out += scheduling(doc)
    bad = [c for c in doc["cells"] if c["status"] != "ok"]
    if bad:
        out += ["", "## Cells not reported", "", "| link | model | system | status | reason |",
                "|---|---|---|---|---|"]
        for c in bad:
            reason = (c.get("error") or "").splitlines()[0][:160].replace("|", "/")
            out.append(f"| {c['link']} | {c['model']} | {c['system']} | {c['status']} | {reason} |")
    return "\n".join(out) + "\n"


PLACED = ("local", "nto", "rrto", "rrto:robot-all", "rrto:min-cut", "rrto:hybrid-parallel")


def _medians(doc: dict[str, Any]) -> dict[tuple[str | None, str, str], float]:
    """(link, model, system) -> median latency of each reported cell (the median of its rounds'
    medians, ``--rounds``); local under every link."""
    rounds: dict[tuple[str | None, str, str], list[float]] = {}
    for c in doc["cells"]:
        if c["status"] == "ok":
            for link in (doc["links"] if c["system"] == "local" else [c["link"]]):
                rounds.setdefault((link, c["model"], c["system"]), []).append(
                    c["latency"]["median"])
    return {k: percentile(v, 50) for k, v in rounds.items()}  # over rounds (``--rounds``)


def scheduling(doc: dict[str, Any]) -> list[str]:
    """Where the calls ran (docs/scheduling.md): rrto under each scheduler beside local and
    nto, per link and model; the robot's slowdown as measured in the same run (local's median
    over the NTO server's own compute of the model, on the host side)."""
    if not any(c["system"].startswith("rrto:") for c in doc["cells"]):
        return []
    med = _medians(doc)
    host = {(c["link"], c["model"]): c.get("host_compute_ms") for c in doc["cells"]
            if c["system"] == "nto" and c["status"] == "ok"}
    out = ["", "## Scheduling: which calls run on the robot (median ms)", "",
           "| link | model | robot slowdown | " + " | ".join(PLACED)
           + " | best of local, rrto | min-cut / best | hybrid / best of local, rrto, min-cut |",
           "|---|---|---|" + "---|" * len(PLACED) + "---|---|---|"]
    for link in doc["links"]:
        for model in dict.fromkeys(c["model"] for c in doc["cells"]):
            row = [med.get((link, model, s)) for s in PLACED]
            if all(v is None for v in row[1:]):
                continue
            local, compute = med.get((link, model, "local")), host.get((link, model))
            slow = local / compute if local and compute else None
            best = min((v for v in (row[0], row[2]) if v is not None), default=None)
            cut, hybrid = row[4], row[5]
            best3 = min((v for v in (row[0], row[2], cut) if v is not None), default=None)
            out.append(f"| {link} | {model} | {_f(slow)} | " + " | ".join(_f(v) for v in row)
                       + f" | {_f(best)} | {_f(cut / best if cut and best else None)}"
                       + f" | {_f(hybrid / best3 if hybrid and best3 else None)} |")
    energy = {(link, c["model"], c["system"]): c["per_inference"].get("energy_j")
              for c in doc["cells"] if c["status"] == "ok" and c.get("per_inference")
              for link in (doc["links"] if c["system"] == "local" else [c["link"]])}
    if any(v is not None for v in energy.values()):
        out += ["", f"Energy per inference (J, {energy_label(doc)}):", "",
                "| link | model | " + " | ".join(PLACED) + " |",
                "|---|---|" + "---|" * len(PLACED)]
        for link in doc["links"]:
            for model in dict.fromkeys(c["model"] for c in doc["cells"]):
                row = [energy.get((link, model, s)) for s in PLACED]
                if any(v is not None for v in row[1:]):
                    out.append(f"| {link} | {model} | " + " | ".join(_f(v) for v in row) + " |")
    out += switching(doc)
    out += ["", "rrto is the default scheduler (remote-all); rrto:robot-all runs every call that "
            "may run on the robot there; rrto:min-cut measures the calls on both sides and the "
            "app's latency of each placement in its first replays, then runs at the "
            "minimum-latency cut for the measured link if the app measures it fastest (its "
            "warm-up must cover those replays: ~25 inferences); rrto:hybrid-parallel measures "
            "as min-cut does, then the split LOSS predicts fastest (robot and host each compute "
            "a band of the rows of the first layers), and keeps whichever the app measured "
            "fastest (~35 inferences). Robot slowdown: local's "
            "median over the NTO server's compute of the same model in the same run.", ""]
    return out


def switching(doc: dict[str, Any]) -> list[str]:
    """Plan switching on fluctuating links (bandwidth traces): min-cut with
    ``switch_plans`` (``rrto:min-cut+switch``), which runs each inference with the plan of the
    link's current band, against the best fixed plan of the same run (local: every call on
    the robot; rrto: every call on the host), by mean and median latency, with how often its
    plan changed."""
    cells = {(c["link"], c["model"], c["system"]): c for c in doc["cells"] if c["status"] == "ok"}
    local = {c["model"]: c for c in doc["cells"] if c["status"] == "ok" and c["system"] == "local"}
    rows = []
    for (link, model, system), c in cells.items():
        if system != "rrto:min-cut+switch" or c.get("window_mbps") is None:
            continue
        fixed = [x for x in (local.get(model), cells.get((link, model, "rrto"))) if x]
        if not fixed:
            continue
        switches = (c.get("per_inference") or {}).get("plan_switches")
        best_mean = min(x["latency"]["mean"] for x in fixed)
        best_median = min(x["latency"]["median"] for x in fixed)
        rows.append(f"| {link} | {model} | {_f(c['window_mbps'])} | {_f(c['latency']['mean'])} | "
                    f"{_f(best_mean)} | {_f(c['latency']['mean'] / best_mean)} | "
                    f"{_f(c['latency']['median'])} | {_f(best_median)} | "
                    f"{_f(c['latency']['median'] / best_median)} | "
                    f"{_f(None if switches is None else switches * c['iters'])} / {c['iters']} |")
    if not rows:
        return []
    return ["", "Plan switching on fluctuating links (rrto:min-cut+switch: each inference runs "
            "the plan of the link's band as last measured; best fixed: the better of local "
            "and rrto in the same run):", "",
            "| link | model | trace mean Mbit/s | min-cut mean ms | best fixed mean | ratio | "
            "min-cut median | best fixed median | ratio | plan switches |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows]


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Median latency per system per link (one panel per link, bars per model), log scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    links = list(doc["links"])
    systems = ["local", "per-op", "nto", "rrto"]
    models = list(dict.fromkeys(c["model"] for c in doc["cells"]))
    fig, axes = plt.subplots(1, max(len(links), 1), figsize=(4.5 * max(len(links), 1), 4), squeeze=False,
                             sharey=True)
    width = 0.8 / len(systems)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # one per system, every panel
    for ax, link in zip(axes[0], links, strict=False):
        for j, system in enumerate(systems):
            xs, ys, errs, wrong = [], [], [], []
            for i, model in enumerate(models):
                cell = next((c for c in doc["cells"] if c["model"] == model and c["system"] == system
                             and (c["status"] == "ok" or wrong_outputs(c))
                             and (c["link"] == link or system == "local")), None)
                if cell:
                    xs.append(i + (j - 1.5) * width)
                    ys.append(cell["latency"]["median"])
                    errs.append(max(cell["latency"]["p90"] - cell["latency"]["median"], 0))
                    wrong.append(cell["status"] != "ok")
            if xs:
                bars = ax.bar(xs, ys, width, yerr=[[0] * len(errs), errs], label=system, capsize=2,
                              color=colors[j % len(colors)])
                for bar, bad in zip(bars, wrong, strict=True):
                    if bad:  # outputs differ from local: failed, and drawn so
                        bar.set_facecolor("white")
                        bar.set_hatch("xx")
                        bar.set_edgecolor("red")
                        ax.annotate("✗", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                    color="red", ha="center", va="bottom", fontsize=12,
                                    fontweight="bold")
        ax.set_title(link)
        ax.set_yscale("log")
        ax.set_xticks(range(len(models)), models, rotation=30, ha="right")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("latency per inference, ms (median, bar to p90)")
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[j % len(colors)], label=s) for j, s in enumerate(systems)]
    if any(wrong_outputs(c) for c in doc["cells"]):
        handles.append(Patch(facecolor="white", edgecolor="red", hatch="xx",
                             label="FAILED: outputs ≠ local"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3 * len(links)),
               fontsize=8, frameon=False)
    fig.suptitle(f"rrtod benchmark {doc['started']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 if len(handles) <= 3 * len(links) else 0.11, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


README_BEGIN = "<!-- bench:begin (bench/report.py writes this block after a full run) -->"
README_END = "<!-- bench:end -->"


def summary(doc: dict[str, Any]) -> str:
    """The README's block: the plot and, per link and model, each system's median latency and
    the two ratios the project is judged on (the whole table: ``bench/results/latest.md``)."""
    median: dict[tuple[Any, str, str], Any] = dict(_medians(doc))
    median.update({(c["link"], c["model"], c["system"]): "FAILED (outputs ≠ local)"
                   for c in doc["cells"] if wrong_outputs(c)})
    m = doc["machine"]
    cpus = doc["plan"].get("cpus")
    where = (f"robot side on CPU {_ints(cpus['robot'])}, GPU host on CPU {_ints(cpus['host'])}"
             if cpus else "the GPU host computes on the same CPU")
    out = [f"Full run of {doc['started']} (commit {str(m.get('git_commit'))[:10]}, "
           f"{m['cpu_count']} CPUs, torch {m['versions']['torch']}; {where}"
           "): median ms per inference, batch 1. Every cell, p90/p99, bytes, energy "
           f"— {energy_label(doc)} — and the targets: "
           "[bench/results/latest.md](bench/results/latest.md).", "",
           "![median latency per system and link](bench/results/latest.png)", "",
           "| link | model | local | per-op | nto | rrto | rrto/nto | penalty removed |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for comp in doc["comparisons"]:
        link, model = comp["link"], comp["model"]
        if not any((link, model, s) in median for s in ("per-op", "nto", "rrto")):
            continue
        row = [_cell(median.get((link, model, "local")))]
        row += [_cell(median.get((link, model, s))) for s in ("per-op", "nto", "rrto")]
        out.append(f"| {link} | {model} | {' | '.join(row)} | {_f(comp['rrto_over_nto'])} | "
                   f"{_f(comp['penalty_removed'])} |")
    return "\n".join(out)


def _cell(value: Any) -> str:
    return f"**{value}**" if isinstance(value, str) else _f(value)


def update_readme(readme: Path, doc: dict[str, Any]) -> bool:
    """Replace the README's benchmark block (between its markers) with ``summary(doc)``."""
    text = readme.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        return False
    readme.write_text(text[:begin + len(README_BEGIN)] + "\n" + summary(doc) + "\n"
                      + text[end:])
    return True


def write(doc: dict[str, Any], out_dir: Path, stamp: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stamp}.json"
    json_path.write_text(json.dumps(doc, indent=1, default=str))
    md_path = out_dir / "latest.md"
    md_path.write_text(markdown(doc, json_path.name))
    paths = {"json": json_path, "markdown": md_path}
    png = plot(doc, out_dir / "latest.png")
    if png:
        paths["png"] = png
    sweep = plot_sweep(doc, out_dir / "scheduling.png")
    if sweep:
        paths["sweep png"] = sweep
    return paths


def plot_sweep(doc: dict[str, Any], path: Path) -> Path | None:
    """Latency against the link's rate per system, one panel per model: the fixed-rate links
    of a run (a bandwidth sweep, ``--links rate-10,...``), when it has two or more."""
    rates = {name: ALL_LINKS[name].mbps for name in doc["links"]
             if ALL_LINKS[name].mbps and not ALL_LINKS[name].trace}
    if len(rates) < 2 or not any(c["system"].startswith("rrto:") for c in doc["cells"]):
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    med = _medians(doc)
    models = list(dict.fromkeys(c["model"] for c in doc["cells"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        for system in PLACED:
            pts = sorted((rate, med[(link, model, system)]) for link, rate in rates.items()
                         if (link, model, system) in med)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system,
                        linestyle="--" if system == "local" else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Mbit/s), RTT 2.6 ms")
        ax.set_title(model)
    axes[0][0].set_ylabel("median latency per inference (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
