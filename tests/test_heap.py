"""``rrtod.heap``: a daemon keeps the memory it frees for its next allocations (glibc).

In child processes: allocator settings are process-wide."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

FREE_AND_MEASURE = """
    import psutil
    from rrtod import heap
    kept = heap.keep_freed_memory()
    me = psutil.Process()
    chunks = [bytearray(1 << 20) for _ in range(64)]  # 64 MiB in 1 MiB chunks, touched
    held = me.memory_info().rss
    del chunks
    after = me.memory_info().rss
    print(kept, (held - after) >> 20)
"""


def freed_mib(**env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(FREE_AND_MEASURE)],
                         capture_output=True, text=True, timeout=60, env={"PATH": "", **env})
    assert out.returncode == 0, out.stderr
    kept, returned = out.stdout.split()
    return kept, int(returned)


def test_freed_memory_stays_with_the_process_for_the_next_inference():
    """With glibc's defaults each 1 MiB chunk is mapped on its own and unmapped when freed:
    the next inference's values land in fresh pages. Kept, they are reused."""
    kept, returned = freed_mib()
    assert kept == "True" and returned < 8
    kept, returned = freed_mib(RRTO_KEEP_FREED="0")  # the switch: glibc's own behaviour
    assert kept == "False" and returned > 48
