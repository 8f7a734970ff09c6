"""GPU hosts: the correctness suite's models, recorded and replayed with the GPU daemon's
executor on CUDA, give what the same unmodified app computes locally on the CPU.

Skipped where torch sees no CUDA device (CI and the development machines); run it on a GPU
host: ``.venv/bin/python -m pytest tests/test_gpu.py``. The host computes float32 in float32
(the executor turns TF32 off), so only the order of floating-point sums differs from the CPU:
outputs are compared within a tolerance, not bitwise."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testkit.apps import APPS, MODELS, app_env
from testkit.daemons import BIN, TEST_DEFAULTS, Launcher

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

RUNS = 8
REL, ABS = 1e-4, 1e-4


@pytest.fixture(scope="module")
def daemon():
    with Launcher(extra_env={"RRTO_OFFLOAD": "0"}) as launcher:
        yield launcher.start("rrtod", **{**TEST_DEFAULTS, "executor": {"device": "cuda"}})


def app(name: str, dump: Path, env: dict[str, str], offload: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(APPS / f"{name}.py"), "--runs", str(RUNS), "--dump", str(dump)]
    if offload:
        cmd = [str(BIN / "rrto-run"), "--", *cmd]
    return subprocess.run(cmd, env=env, cwd=APPS, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", MODELS)
def test_replayed_on_cuda_equals_local_cpu(daemon, name, tmp_path):
    env = app_env()
    local = app(name, tmp_path / "local.json", {**env, "CUDA_VISIBLE_DEVICES": ""}, False)
    assert local.returncode == 0, local.stderr
    remote = app(name, tmp_path / "remote.json",
                 {**env, **daemon.env, "RRTO_REPLAY": "1", "RRTO_STATS": "1"}, True)
    assert remote.returncode == 0, remote.stderr
    a = json.loads((tmp_path / "remote.json").read_text())
    b = json.loads((tmp_path / "local.json").read_text())
    assert a.keys() == b.keys()
    for k in a:
        assert len(a[k]) == len(b[k]), k
        bad = [(x, y) for x, y in zip(a[k], b[k], strict=True)
               if not math.isclose(x, y, rel_tol=REL, abs_tol=ABS)]
        assert not bad, f"{name} {k}: {len(bad)} of {len(a[k])} values differ, e.g. {bad[:3]}"
    stats = json.loads(remote.stderr.splitlines()[-1].removeprefix("rrto-stats "))
    assert stats["replays"] >= RUNS - 3, stats
    assert daemon.ctl("status")["gpu"]["device"].startswith("cuda")
