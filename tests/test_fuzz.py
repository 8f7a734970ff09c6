"""A short coverage-guided fuzzing round of every decoder of socket bytes (tests/fuzz): each
target runs a few seconds from its committed corpus and must neither crash nor raise anything
but its documented errors. ``make fuzz`` runs the same targets longer and keeps the corpus.
RRTO_FUZZ_SECONDS sets the seconds (default 10; all targets run at once: about a minute)."""

from __future__ import annotations

import os

import pytest

from tests.fuzz import TARGET_NAMES
from tests.fuzz.campaign import Result, run_targets

SECONDS = float(os.environ.get("RRTO_FUZZ_SECONDS", "10"))


@pytest.fixture(scope="module")
def fuzz_round(tmp_path_factory) -> dict[str, Result]:
    """Every target at once (their start-up, mostly importing torch, overlaps)."""
    work = tmp_path_factory.mktemp("fuzz")
    results = run_targets(list(TARGET_NAMES), SECONDS, work, seed=1, parallel=len(TARGET_NAMES))
    return {r.target: r for r in results}


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_fuzz_target_short_run(target, fuzz_round):
    result = fuzz_round[target]
    print(f"fuzz {target}: {result.executed} inputs, {result.new_units} new, "
          f"peak RSS {result.peak_rss_mb} MB")
    assert result.ok, (f"{target} crashed ({[str(c) for c in result.crashes]}):\n"
                       + result.output[-4000:])
    # it ran the target, not only the start-up; native_runs replays real operators for each
    # input (two inferences of a small CNN, the first operators' lazy set-up in the first):
    # 40-70 inputs in this round on two cores, thousands in a round of its own
    assert result.executed >= (20 if target == "native_runs" else 100)
