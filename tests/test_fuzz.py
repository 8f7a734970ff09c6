"""A short coverage-guided fuzzing round of every decoder of socket bytes (tests/fuzz): each
target runs a few seconds from its committed corpus and must neither crash nor raise anything
but its documented errors. ``make fuzz`` runs the same targets longer and keeps the corpus.
RRTO_FUZZ_SECONDS sets the seconds (default 10; all targets run at once: about a minute)."""

from __future__ import annotations

import os

import pytest

from tests.fuzz import TARGET_NAMES
from tests.fuzz.campaign import Result, finish_target, start_target

SECONDS = float(os.environ.get("RRTO_FUZZ_SECONDS", "10"))
# native_runs replays real operators for each input (two inferences of a small CNN): in a
# round of ``SECONDS`` beside the others on two cores it ran 2-70 inputs as the machine was
# loaded, so it runs a number of inputs instead, within a cap of its own
NATIVE_RUNS, NATIVE_CAP_S = 24, max(SECONDS, 90.0)


@pytest.fixture(scope="module")
def fuzz_round(tmp_path_factory) -> dict[str, Result]:
    """Every target at once (their start-up, mostly importing torch, overlaps)."""
    work = tmp_path_factory.mktemp("fuzz")
    timed = [t for t in TARGET_NAMES if t != "native_runs"]
    procs = [(t, start_target(t, SECONDS, work, seed=1), SECONDS) for t in timed]
    if "native_runs" in TARGET_NAMES:
        procs.append(("native_runs", start_target("native_runs", NATIVE_CAP_S, work, seed=1,
                                                  extra=[f"-runs={NATIVE_RUNS}"]), NATIVE_CAP_S))
    return {t: finish_target(t, proc, seconds, work) for t, proc, seconds in procs}


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_fuzz_target_short_run(target, fuzz_round):
    result = fuzz_round[target]
    print(f"fuzz {target}: {result.executed} inputs, {result.new_units} new, "
          f"peak RSS {result.peak_rss_mb} MB")
    assert result.ok, (f"{target} crashed ({[str(c) for c in result.crashes]}):\n"
                       + result.output[-4000:])
    # it ran the target, not only the start-up (native_runs: its inputs within its cap). A
    # slow target on a loaded machine (robot_scheduling, no committed corpus: 93 inputs in 10 s
    # on a 2-CPU host 2-3x slower than usual) shows it by the new inputs it kept instead.
    assert result.executed >= (NATIVE_RUNS if target == "native_runs" else 100) \
        or (target != "native_runs" and result.new_units >= 10), result.output[-2000:]
