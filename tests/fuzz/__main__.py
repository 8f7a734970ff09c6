"""Run one fuzz target under atheris (libFuzzer, coverage-guided).

    python -m tests.fuzz TARGET [libFuzzer options] [CORPUS_DIR ...]

e.g. ``python -m tests.fuzz frames -max_total_time=60 tests/fuzz/corpus/frames``. Only
rrtod's own code that the target reaches is instrumented for coverage (``TARGET_CODE``; torch
and protobuf are imported first, as they are): the fuzzer steers by what the daemons' Python
does with the bytes. Log lines at error level or above raise: a bug the daemon would only have
logged counts as a crash here.
``make fuzz`` runs every target and keeps the corpus; tests/test_fuzz.py runs a short round.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

# Imported here, uninstrumented: third-party code the targets call is not what is fuzzed
# (``torch._dynamo``: imported by the host's first meta execution of some operators, 1.7 s
# here; the unit that reached it first was reported slow).
import atheris
import google.protobuf  # noqa: F401
import grpc  # noqa: F401
import numpy  # noqa: F401
import structlog
import torch  # noqa: F401
import torch._dynamo  # noqa: F401

from tests.fuzz import TARGET_CODE


def fail_on_error_logs(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    if method in ("error", "exception", "critical"):
        raise AssertionError(f"logged at {method}: {event.get('event')} {event}")
    raise structlog.DropEvent


def _self_command(target: str) -> str:
    """An executable that runs this target: libFuzzer re-executes ``argv[0]`` for ``-merge``
    and ``-fork``, and ``python -m`` leaves a non-executable path there."""
    repo = Path(__file__).resolve().parents[2]
    folder = os.environ.get("RRTO_FUZZ_STATE") or tempfile.mkdtemp(prefix="rrto-fuzz-")
    Path(folder).mkdir(parents=True, exist_ok=True)
    script = Path(folder) / f"fuzz-{target}"
    script.write_text(f"#!/bin/sh\ncd {shlex.quote(str(repo))} && exec "
                      f"{shlex.quote(sys.executable)} -m tests.fuzz {shlex.quote(target)} \"$@\"\n")
    script.chmod(0o755)
    return str(script)


# The packages whose modules may be instrumented. atheris takes whole top-level packages, and
# exact module names to leave out: ``_not_reached`` lists those a target does not reach.
_PACKAGES = ("rrtod", "rrto_plugins", "testkit", "tests")


def _not_reached(code: tuple[str, ...]) -> list[str]:
    """Every module of ``_PACKAGES`` (found on disk, importing nothing) outside ``code``'s
    name prefixes (``tests``: only its fuzz package)."""
    names = []
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in Path(root).rglob("*.py"):
                parts = path.relative_to(root).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                names.append(".".join((package, *parts)))
    return [n for n in names
            if not any(n == c or n.startswith(c + ".") for c in code)]


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    name = sys.argv.pop(1)
    structlog.configure(processors=[fail_on_error_logs],
                        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    if name not in TARGET_CODE:
        sys.exit(f"unknown target {name!r}; targets: {', '.join(TARGET_CODE)}")
    code = (*TARGET_CODE[name], "tests.fuzz.protogen")
    with atheris.instrument_imports(include=list(_PACKAGES), exclude=_not_reached(code)):
        from tests.fuzz.targets import TARGETS
    if any(arg.startswith(("-merge=", "-fork=", "-jobs=")) for arg in sys.argv):
        sys.argv[0] = _self_command(name)
    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
