"""Sequence searches (``rrtod.hookspecs.SequenceSearch``): find one inference's operator sequence
in an op log, with no hint from the app. Each proposes candidates; ``rrtod.robot.search.verify``
decides."""

from __future__ import annotations

from rrtod.hookspecs import PluginRecord, SearchFactory, hookimpl

from .dds import DataDependencySearch
from .period import PeriodSearch


@hookimpl
def rrto_sequence_searches() -> list[PluginRecord[SearchFactory]]:
    return [
        PluginRecord("dds", DataDependencySearch,
                     "Data Dependency Search: periods from downloads, starts from dataflow"),
        PluginRecord("period", PeriodSearch, "smallest period of operator keys (KMP), any phase"),
    ]
