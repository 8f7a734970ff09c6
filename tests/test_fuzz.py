"""A short coverage-guided fuzzing round of every decoder of socket bytes (tests/fuzz): each
target runs a few seconds from its committed corpus and must neither crash nor raise anything
but its documented errors. ``make fuzz`` runs the same targets longer and keeps the corpus.
RRTO_FUZZ_SECONDS sets the seconds per target (default 8: about a minute in all)."""

from __future__ import annotations

import os

import pytest

from tests.fuzz import TARGET_NAMES
from tests.fuzz.campaign import run_target

SECONDS = float(os.environ.get("RRTO_FUZZ_SECONDS", "8"))


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_fuzz_target_short_run(target, tmp_path):
    result = run_target(target, SECONDS, tmp_path, seed=1)
    print(f"fuzz {target}: {result.executed} inputs, {result.new_units} new, "
          f"peak RSS {result.peak_rss_mb} MB")
    assert result.ok, (f"{target} crashed ({[str(c) for c in result.crashes]}):\n"
                       + result.output[-4000:])
    assert result.executed >= 100  # it ran the target, not only the start-up
