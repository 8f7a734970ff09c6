"""Run the fuzz targets one after another and keep the corpus: ``make fuzz``.

    python -m tests.fuzz.campaign [--seconds 120] [--seed 0] [--keep-corpus] [TARGET ...]

Each target runs in its own process (libFuzzer runs once per process) for ``--seconds``,
starting from its committed corpus in tests/fuzz/corpus/<target>/ and the inputs that once
crashed it in tests/fuzz/regressions/<target>/. With ``--keep-corpus`` the
corpus is then minimized (libFuzzer ``-merge=1``: the smallest set of inputs with the same
coverage) and written back, so the repository keeps a small corpus that grows in coverage.
Prints inputs executed and crashes per target; a crash's input is left in the work folder
and its traceback printed. tests/test_fuzz.py runs the same for a few seconds per target.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.fuzz import TARGET_NAMES

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "fuzz" / "corpus"
# Inputs that once crashed a target (named after the bug): always run, never minimized away.
REGRESSIONS = REPO / "tests" / "fuzz" / "regressions"
MAX_LEN = 2048  # bytes per input: messages the decoders see are built from at most this
OPTIONS = [f"-max_len={MAX_LEN}", "-rss_limit_mb=2048", "-timeout=20", "-print_final_stats=1"]
# Long runs try long inputs (deep messages) from the start, instead of growing the length
# limit slowly: fewer inputs a second, more of them reach past the first field.
LONG_RUN = ["-len_control=0"]


@dataclass
class Result:
    target: str
    returncode: int
    executed: int
    new_units: int
    peak_rss_mb: int
    crashes: list[Path]
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.crashes


def _stat(name: str, output: str) -> int:
    m = re.search(rf"stat::{name}:\s+(\d+)", output)
    return int(m.group(1)) if m else 0


def _env(work: Path) -> dict[str, str]:
    return {**os.environ, "RRTO_FUZZ_STATE": str(work / "state")}


def start_target(target: str, seconds: float, work: Path, seed: int = 0,
                 extra: list[str] | None = None) -> subprocess.Popen[str]:
    """Start fuzzing ``target`` for ``seconds`` from its committed corpus (read only); new
    inputs and crashes go to ``work``."""
    new = work / "new" / target
    new.mkdir(parents=True, exist_ok=True)
    corpus = CORPUS / target
    corpus.mkdir(parents=True, exist_ok=True)
    artifacts = work / "crashes" / target
    artifacts.mkdir(parents=True, exist_ok=True)
    regressions = [str(p) for p in [REGRESSIONS / target] if p.is_dir()]
    cmd = [sys.executable, "-m", "tests.fuzz", target, f"-max_total_time={int(seconds)}",
           f"-seed={seed}", f"-artifact_prefix={artifacts}/", *OPTIONS, *(extra or []),
           str(new), str(corpus), *regressions]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(work))


def finish_target(target: str, proc: subprocess.Popen[str], seconds: float, work: Path) -> Result:
    try:
        output, _ = proc.communicate(timeout=seconds + 180)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    return Result(target, proc.returncode, _stat("number_of_executed_units", output),
                  _stat("new_units_added", output), _stat("peak_rss_mb", output),
                  sorted((work / "crashes" / target).iterdir()), output)


def run_targets(targets: list[str], seconds: float, work: Path, seed: int = 0,
                extra: list[str] | None = None, parallel: int = 1) -> list[Result]:
    """Fuzz each target for ``seconds``, ``parallel`` at a time (start-up, mostly importing
    torch, then overlaps)."""
    results: list[Result] = []
    for i in range(0, len(targets), parallel):
        group = targets[i:i + parallel]
        procs = [(t, start_target(t, seconds, work, seed, extra)) for t in group]
        results += [finish_target(t, p, seconds, work) for t, p in procs]
    return results


def minimize_into_corpus(target: str, work: Path) -> int:
    """Merge the committed corpus and the new inputs into their smallest equivalent set and
    write it back; returns the number of files kept."""
    merged = work / "merged" / target
    merged.mkdir(parents=True, exist_ok=True)
    corpus = CORPUS / target
    subprocess.run([sys.executable, "-m", "tests.fuzz", target, "-merge=1", *OPTIONS,
                    str(merged), str(corpus), str(work / "new" / target)],
                   cwd=REPO, capture_output=True, check=True, timeout=600, env=_env(work))
    shutil.rmtree(corpus)
    shutil.copytree(merged, corpus)
    return len(list(corpus.iterdir()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", default=list(TARGET_NAMES))
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0, help="0: a new seed each run")
    ap.add_argument("--keep-corpus", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rrto-fuzz-"))
    print(f"work folder (new inputs, crashes): {work}")
    failed = False
    print(f"{'target':14} {'inputs':>10} {'new':>6} {'rss MB':>7} {'crashes':>8} {'corpus':>7}")
    for target in args.targets:
        (r,) = run_targets([target], args.seconds, work, args.seed, LONG_RUN)
        kept = minimize_into_corpus(target, work) if args.keep_corpus and r.ok else "-"
        print(f"{target:14} {r.executed:10} {r.new_units:6} {r.peak_rss_mb:7} "
              f"{len(r.crashes):8} {kept:>7}")
        if not r.ok:
            failed = True
            print(r.output[-6000:], file=sys.stderr)
            for crash in r.crashes:
                print(f"  crash input: {crash}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
