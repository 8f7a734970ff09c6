"""The native host replay loop (``hostloop.cpp``), compiled against the torch that runs it.

Built at install (``python -m rrto_plugins.torch.native``; ``make install`` runs it, ~30 s with
g++ and ninja), never in a daemon's replay path: a daemon loads the build made for this source,
this torch and this Python, and where there is none (no compiler when it was installed, another
torch since) it replays in Python - the same results, ~10 us more a call - and says why once.
``RRTO_NATIVE=0`` turns it off. Robots and hosts with vendor torch builds compile it against
their own: the module's name carries a digest of all three, so a stale build is never loaded.
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

SOURCE = Path(__file__).with_name("hostloop.cpp")
log = structlog.get_logger("rrto.torch.native")


def name() -> str:
    """The module's name for this source, torch and Python."""
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()
                            + sys.version.encode()).hexdigest()[:12]
    return f"rrto_hostloop_{digest}"


def build_root() -> Path:
    """Where builds live: ``RRTO_NATIVE_DIR``, else beside the environment's own files."""
    return Path(os.environ.get("RRTO_NATIVE_DIR") or Path(sys.prefix) / "share" / "rrto" / "native")


def library() -> Path:
    return build_root() / name() / f"{name()}.so"


def build(verbose: bool = False) -> Path:
    """Compile the loop for this torch (a no-op when that build is there)."""
    from torch.utils import cpp_extension

    where = build_root() / name()
    where.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=name(), sources=[str(SOURCE)], build_directory=str(where),
                       extra_cflags=["-O2"], verbose=verbose)
    return library()


@functools.cache
def module() -> Any | None:
    """The compiled loop, or None: turned off, or not built for this torch."""
    if not flag("RRTO_NATIVE", True):
        return None
    path = library()
    if not path.exists():
        log.info("native host loop not built: replaying in Python",
                 build="python -m rrto_plugins.torch.native", expected=str(path))
        return None
    try:
        spec = importlib.util.spec_from_file_location(name(), path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as exc:
        log.warning("native host loop did not load: replaying in Python", path=str(path),
                    error=str(exc))
        return None
    return mod


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rrto_plugins.torch.native",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless a build for this torch is there (builds nothing)")
    args = parser.parse_args(argv)
    if args.check:
        there = library().exists()
        print(f"{library()}: {'built' if there else 'not built'}")
        return 0 if there else 1
    t0 = time.monotonic()
    try:
        path = build(args.verbose)
    except Exception as exc:  # noqa: BLE001 - no compiler: the daemons replay in Python
        print(f"native host loop not built ({type(exc).__name__}: {exc}); "
              "the GPU daemon replays in Python", file=sys.stderr)
        return 1
    print(f"native host loop: {path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
