"""docs/compatibility.md from the corpus's rows (compat/results/latest.json): counts, then one
table row per model and idiom; and the README's block with the same counts (``counts`` computes
them once for both, so the two pages cannot tell different numbers). Written by ``python -m
compat`` after every entry, so a run cut short still leaves a true (if partial) page.

``python -m compat.report [MORE.json ...]`` merges rows of other runs into latest.json and
rewrites both pages; with no argument it only rewrites the pages from latest.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _kb(n: Any) -> str:
    return "-" if n is None else f"{n / 1e3:.1f} kB"


def _ms(s: Any) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def _equal(r: dict[str, Any]) -> str:
    if r.get("status") not in ("ok", "differs"):
        return "-"
    if r.get("bitwise"):
        return "bitwise"
    if "max_abs_diff" in r:
        return f"{r['max_abs_diff']:.2g}" + (" (tol)" if r["status"] == "ok" else " (no)")
    return "no"


def _replay(r: dict[str, Any]) -> str:
    by = (r.get("by_inference") or {}).get("replays")
    if by is None:
        return "-"
    n = sum(by)
    if n:
        return f"{n} of {len(by)}"
    why = "no sequence found"
    says = " ".join(r.get("daemon_says") or [])
    if "refused" in says:
        why = "host refused the sequence"
    elif r.get("mismatches"):
        why = f"{r['mismatches']} mismatches"
    return f"0 of {len(by)}: {why}"


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The headline numbers: models whose outputs equal local (``ok``) of those measured, how
    many of those replay, idioms passing of those measured."""
    models = [r for r in rows if r["library"] != "idiom"]
    idioms = [r for r in rows if r["library"] == "idiom"]
    ok = [r for r in models if r["status"] == "ok"]
    return {"models": len(models), "ok": len(ok),
            "replay": sum(1 for r in ok if sum((r.get("by_inference") or {}).get("replays")
                                               or [0])),
            "idioms": len(idioms), "idioms_ok": sum(r["status"] == "ok" for r in idioms)}


def headline(rows: list[dict[str, Any]]) -> str:
    """One sentence with the counts, the same on docs/compatibility.md and in the README."""
    c = counts(rows)
    return (f"**{c['ok']} of {c['models']} models offload correctly** (outputs equal to local), "
            f"**{c['replay']} replay**; {c['idioms_ok']} of {c['idioms']} idioms pass")



def _when(rows: list[dict[str, Any]]) -> str:
    """When the rows were measured: a ``--only`` run re-measures its entries and keeps the
    others' rows, so a table may span several runs (and commits); say so instead of hiding it."""
    times = sorted(r["measured"] for r in rows if r.get("measured"))
    if not times or times[0][:16] == times[-1][:16]:
        return ""
    return (f", measured from {times[0]} to {times[-1]} (a `--only` run re-measures its "
            "entries and keeps the other rows; each row's time is in compat/results/latest.json)")

def write_report(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    v = meta["versions"]
    lines = [
        "# Compatibility with real model code",
        "",
        "Written by `make compat` (`python -m compat`, compat/): third-party models built from "
        "their configs with random weights, each run as a small app loop (batch 1, one input "
        f"size, {meta['frames']} frames) locally and under `rrto-run` against one rrtod (robot "
        "and GPU roles) on this machine. The model list is data (compat/models.yaml); the app "
        "idioms are small apps in compat/idioms/.",
        "",
        f"Run of {meta['started']}: torch {v['torch']}, torchvision {v['torchvision']}, timm "
        f"{v['timm']}, transformers {v['transformers']}, ultralytics {v['ultralytics']}; "
        f"Python {meta['python']}, {meta['cpus']} CPUs shared with other work (latencies are "
        "noisy); the GPU host computes on the same CPU.",
        "",
        f"{headline(rows)}; {len(rows)} entries{_when(rows)}.",
        "",
        "Columns: *equal*: outputs against local execution of the same app (bitwise, or the "
        "max abs difference); *ops/inf*: operators per inference (forwarded + replayed + run "
        "locally, mean over the run); *replayed*: inferences answered by replay, else why not; "
        "*RT*: round trips the app waited for in the last (steady) inference; *wire/inf*: "
        f"bytes on the wire per inference over the last {meta['window']} frames (daemon "
        "counters, `rrtoctl status`), against the inference's input + output bytes; *local "
        "ops*: operators the shim ran locally; latency: median of the last frames, local / "
        "offloaded over loopback, ms.",
        "",
        "| model | library | status | equal | ops/inf | replayed | RT | wire/inf | in+out | "
        "local ops | latency local / offl. ms |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        status = r["status"]
        if r.get("symptom") and status != "ok":
            status += ": " + r["symptom"].replace("|", "\\|")[:140]
        lines.append(
            f"| {r['name']} | {r['library']} | {status} | {_equal(r)} | "
            f"{r.get('ops_per_inference', '-')} | {_replay(r)} | "
            f"{r.get('steady_round_trips', '-')} | {_kb(r.get('wire_bytes_per_inference'))} | "
            f"{_kb(r.get('io_bytes_per_inference'))} | {r.get('local_ops', '-')} | "
            f"{_ms(r.get('latency_local_s'))} / {_ms(r.get('latency_offloaded_s'))} |")
    lines += ["", "Per row, the daemon's record/replay log lines, the shim's warnings and the "
              "stderr of failures: compat/results/latest.json.", ""]
    path.write_text("\n".join(lines))


README_BEGIN = ("<!-- compat:begin (compat/report.py writes this block from "
                "compat/results/latest.json) -->")
README_END = "<!-- compat:end -->"


def readme_block(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The README's block: the counts of the committed run and the link to its table."""
    v = meta["versions"]
    return (f"{headline(rows)} in the latest run of `make compat` ({meta['started']}, torch "
            f"{v['torch']}, torchvision {v['torchvision']}, timm {v['timm']}, transformers "
            f"{v['transformers']}, ultralytics {v['ultralytics']}): per model and idiom, the "
            "status, output difference, replay or why not, round trips, bytes on the wire and "
            "latency in [docs/compatibility.md](docs/compatibility.md).")


def update_readme(readme: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> bool:
    """Replace the README's compat block (between its markers) with ``readme_block``; a README
    without the markers is left alone (False)."""
    text = readme.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        return False
    readme.write_text(text[:begin + len(README_BEGIN)] + "\n" + readme_block(meta, rows) + "\n"
                      + text[end:])
    return True


def merge(results: Path, doc: Path, extra: list[Path], readme: Path | None = None) -> None:
    """Rows of other runs (``python -m compat --results X``) into ``results``: a row of a later
    file replaces the same model's row; the page (and ``readme``'s block) is rewritten from the
    merged rows. With no ``extra``, only the pages are rewritten."""
    import json

    from compat.__main__ import load_entries_all
    base = json.loads(results.read_text())
    rows = {r["name"]: r for r in base["rows"]}
    for path in extra:
        for r in json.loads(path.read_text())["rows"]:
            rows[r["name"]] = r
    if not extra:
        ordered = base["rows"]
    else:
        ordered = [rows[n] for n in load_entries_all() if n in rows]
        base["rows"] = ordered
        base["meta"]["merged_from"] = [str(p) for p in extra]
        results.write_text(json.dumps(base, indent=1, default=str))
    write_report(doc, base["meta"], ordered)
    if readme is not None:
        update_readme(readme, base["meta"], ordered)


if __name__ == "__main__":
    import sys

    from compat.__main__ import DOC, README, RESULTS
    merge(RESULTS, DOC, [Path(p) for p in sys.argv[1:]], README)
