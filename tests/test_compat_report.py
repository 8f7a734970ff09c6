"""The compatibility corpus's bookkeeping, without its venv (these tests only read files and
run the driver's control flow with a stand-in for the app runs): the README's counts block
agrees with the committed compat/results/latest.json and with docs/compatibility.md; CI's
subset covers every library and idiom; ``--strict`` fails a run with a row that is not ok; a
run into a scratch directory leaves the committed pages alone."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import yaml

import compat.__main__ as driver
from compat.report import (
    README_BEGIN,
    README_END,
    counts,
    headline,
    readme_block,
    update_readme,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
META = {"started": "2026-01-01T00:00:00Z", "python": "3.11", "cpus": 2, "frames": 5, "window": 2,
        "versions": {p: "1.0" for p in ("torch", "torchvision", "timm", "transformers",
                                        "ultralytics")}}


def _row(name: str, library: str, status: str, replays: list[int] | None = None) -> dict:
    row = {"name": name, "library": library, "status": status}
    if replays is not None:
        row["by_inference"] = {"replays": replays}
    return row


def _block(text: str) -> str:
    begin, end = text.find(README_BEGIN), text.find(README_END)
    assert 0 <= begin < end, "README.md lost its compat:begin/compat:end markers"
    return text[begin + len(README_BEGIN):end].strip("\n")


def test_readme_counts_agree_with_the_committed_results():
    """The README states what latest.json says (``python -m compat.report`` rewrites both
    pages from it when they drift), and docs/compatibility.md tells the same counts."""
    results = json.loads((ROOT / "compat" / "results" / "latest.json").read_text())
    block = _block((ROOT / "README.md").read_text())
    assert block == readme_block(results["meta"], results["rows"]), \
        "README's compat block is stale: `.venv/bin/python -m compat.report` rewrites it"
    assert "docs/compatibility.md" in block
    assert headline(results["rows"]) in (ROOT / "docs" / "compatibility.md").read_text()


def test_counts_take_only_ok_models_that_replay():
    rows = [_row("a", "timm", "ok", [0, 0, 1, 1]), _row("b", "timm", "ok", [0, 0, 0]),
            _row("c", "torchvision", "differs", [0, 1, 1]), _row("d", "ultralytics", "crash"),
            _row("idiom-x", "idiom", "ok"), _row("idiom-y", "idiom", "timeout")]
    assert counts(rows) == {"models": 4, "ok": 2, "replay": 1, "idioms": 2, "idioms_ok": 1}
    assert headline(rows).startswith("**2 of 4 models offload correctly**")


def test_update_readme_replaces_only_its_block(tmp_path):
    rows = [_row("a", "timm", "ok", [1])]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nold counts\n{README_END}\noutro\n")
    assert update_readme(readme, META, rows)
    text = readme.read_text()
    assert text.startswith(f"intro\n{README_BEGIN}\n") and text.endswith(f"{README_END}\noutro\n")
    assert _block(text) == readme_block(META, rows) and "old counts" not in text
    plain = tmp_path / "other.md"
    plain.write_text("no markers\n")
    assert not update_readme(plain, META, rows) and plain.read_text() == "no markers\n"


def test_ci_subset_covers_every_library_and_idiom():
    """`make compat-ci` runs one or two models of each library of the corpus, and every idiom."""
    corpus = yaml.safe_load((ROOT / "compat" / "models.yaml").read_text())
    picked = driver.load_entries(driver.argparse.Namespace(
        ci=True, idioms_only=False, models_only=False, only=None))
    models = [e for e in picked if e["library"] != "idiom"]
    libraries = {e["library"] for e in corpus}
    for lib in libraries:
        assert 1 <= sum(e["library"] == lib for e in models) <= 2, lib
    from compat.idioms import IDIOMS
    assert {e["idiom"] for e in picked if e["library"] == "idiom"} == set(IDIOMS)


@pytest.mark.parametrize("strict", [False, True])
def test_strict_run_fails_on_a_row_that_is_not_ok(tmp_path, monkeypatch, strict):
    """The driver's exit status, and where a scratch run writes: only to --results/--doc."""
    statuses = {"idiom-threads": "ok", "idiom-fork_child": "crash"}

    class NoDaemon:
        def start(self, *args, **kwargs):
            return None

    monkeypatch.setattr(driver, "Launcher", lambda **kw: contextlib.nullcontext(NoDaemon()))
    monkeypatch.setattr(driver, "measure", lambda entry, *a: {
        "name": entry["name"], "library": entry["library"], "status": statuses[entry["name"]],
        "symptom": "boom"})
    committed = {p: p.read_text() for p in (driver.README, driver.DOC, driver.RESULTS)}
    argv = ["--only", ",".join(statuses), "--results", str(tmp_path / "r.json"),
            "--doc", str(tmp_path / "c.md"), *(["--strict"] if strict else [])]
    assert driver.main(argv) == (1 if strict else 0)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["name"]: r["status"] for r in rows} == statuses
    assert "**0 of 0 models" in (tmp_path / "c.md").read_text()
    assert {p: p.read_text() for p in committed} == committed
    statuses["idiom-fork_child"] = "ok"
    assert driver.main(argv) == 0


def test_failures_name_each_row_that_is_not_ok():
    rows = [_row("a", "timm", "ok"), {**_row("b", "timm", "timeout"), "symptom": "no exit"}]
    assert driver.failures(rows) == ["b: timeout no exit"]


def test_write_report_states_the_headline(tmp_path):
    rows = [_row("a", "timm", "ok", [0, 1])]
    write_report(tmp_path / "c.md", META, rows)
    assert headline(rows) in (tmp_path / "c.md").read_text()
