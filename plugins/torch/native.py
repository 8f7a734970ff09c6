"""The native parts, compiled against the torch that runs them: the GPU host's replay loop
(``hostloop.cpp``) and the shim's hot path (``shimstep.cpp``).

Built at install (``python -m rrto_plugins.torch.native``; ``make install`` runs it, ~30 s with
g++ and ninja), never in a daemon's or an app's path: a process loads the build made for this
source, this torch and this Python, and where there is none (no compiler when it was installed,
another torch since) it runs the Python path - the same results, ~10 us more a call - and says
why once. ``RRTO_NATIVE=0`` turns both off. Robots and hosts with vendor torch builds compile
them against their own: a module's name carries a digest of all three, so a stale build is
never loaded.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from rrtod.switches import flag

# what each part is, by its source's stem: the module names say which part they build
PARTS = {"hostloop": "native host replay loop", "shimstep": "native shim hot path"}
log = structlog.get_logger("rrto.torch.native")


def source(part: str) -> Path:
    return Path(__file__).with_name(f"{part}.cpp")


def name(part: str = "hostloop") -> str:
    """The module's name for this part's source, torch and Python."""
    digest = hashlib.sha256(source(part).read_bytes() + torch.__version__.encode()
                            + sys.version.encode()).hexdigest()[:12]
    return f"rrto_{part}_{digest}"


def build_root() -> Path:
    """Where builds live: ``RRTO_NATIVE_DIR``, else beside the environment's own files."""
    return Path(os.environ.get("RRTO_NATIVE_DIR") or Path(sys.prefix) / "share" / "rrto" / "native")


def library(part: str = "hostloop") -> Path:
    return build_root() / name(part) / f"{name(part)}.so"


def build(part: str = "hostloop", verbose: bool = False) -> Path:
    """Compile a part for this torch (a no-op when that build is there)."""
    from torch.utils import cpp_extension

    where = build_root() / name(part)
    where.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=name(part), sources=[str(source(part))], build_directory=str(where),
                       extra_cflags=["-O2"], verbose=verbose)
    return library(part)


@functools.cache
def module(part: str = "hostloop") -> Any | None:
    """A compiled part, or None: turned off, or not built for this torch."""
    if not flag("RRTO_NATIVE", True):
        return None
    path = library(part)
    what = PARTS[part]
    if not path.exists():
        log.info(f"{what} not built: running it in Python",
                 build="python -m rrto_plugins.torch.native", expected=str(path))
        return None
    try:
        spec = importlib.util.spec_from_file_location(name(part), path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as exc:
        log.warning(f"{what} did not load: running it in Python", path=str(path),
                    error=str(exc))
        return None
    return mod


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rrto_plugins.torch.native",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every part is built for this torch (builds nothing)")
    parser.add_argument("parts", nargs="*", choices=[*PARTS, []], metavar="PART",
                        help=f"what to build: {', '.join(PARTS)} (default: all)")
    args = parser.parse_args(argv)
    parts = args.parts or list(PARTS)
    if args.check:
        missing = 0
        for part in parts:
            there = library(part).exists()
            missing += not there
            print(f"{library(part)}: {'built' if there else 'not built'}")
        return 1 if missing else 0
    failed = 0
    for part in parts:
        t0 = time.monotonic()
        try:
            path = build(part, args.verbose)
        except Exception as exc:  # noqa: BLE001 - no compiler: the Python path runs instead
            print(f"{PARTS[part]} not built ({type(exc).__name__}: {exc}); "
                  "it runs in Python", file=sys.stderr)
            failed += 1
            continue
        print(f"{PARTS[part]}: {path} ({time.monotonic() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
