"""``make demo``, the README's main job: the unmodified camera loop run locally and offloaded
through a robot and a GPU daemon over the emulated Wi-Fi link gives identical outputs, and the
offloaded run is replayed (one request per frame) once its sequence is found."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_offloads_the_camera_loop_with_identical_outputs() -> None:
    out = subprocess.run([sys.executable, "-m", "rrtod.demo", "--frames", "8"], cwd=REPO,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outputs identical: yes" in out.stdout
    replayed = re.search(r"frames replayed \(1 request each\)\s+-\s+(\d+) of 8", out.stdout)
    assert replayed and int(replayed.group(1)) >= 8 - 4, out.stdout
    assert re.search(r"app CPU time / frame\s+[\d.]+ ms\s+[\d.]+ ms", out.stdout), out.stdout
