"""The test apps (``tests/apps``): unmodified PyTorch scripts that print, per output tensor, its
dtype, shape, a hash of its bytes and a few values (``appkit.describe``). The correctness
tests and the benchmark run them locally and offloaded and compare what they print.

Stdlib only at import: ``bench.replay`` imports this inside app processes, before torch.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from testkit.daemons import BIN, ECHO_PLUGIN

APPS = Path(__file__).resolve().parent.parent / "tests" / "apps"
MODELS = ["mlp_policy", "small_cnn", "resnet", "unet", "gru", "transformer", "detection"]
# The transformer block takes PyTorch's fused CPU fast path locally; with proxies it takes the
# composite path (the fast path refuses tensor subclasses), so sums run in another order: its
# values may differ from local ones by this much (absolute), its hashes then differ too.
TOLERANCE = {"transformer": 1e-5}
# A daemon that runs the apps: the host library of the custom-op app (tests/apps/hostlib) and
# the echo plugin on its path, and offloading off inside the daemon itself.
DAEMON_ENV = {"PYTHONPATH": os.pathsep.join([str(APPS / "hostlib"), str(ECHO_PLUGIN)]),
              "RRTO_OFFLOAD": "0"}
# Host config allowing the custom-op apps' operators (tests/apps/custom_op.py, skewed_op.py).
HOST = {"executor": {"allow_extra": ["rrtotest::scale", "rrtotest::blend"]}}

# With RRTO_STATS=1 the shim prints its counters as one such line on stderr at exit.
STATS_PREFIX = "rrto-stats "
_LINE = re.compile(r"^(\S+ \S+ \[[^\]]*\]) [0-9a-f]+ \[.*\]$")  # appkit.describe's line


def app_env(**extra: str) -> dict[str, str]:
    """This process's environment for an app process, without any ``RRTO_`` switch or
    ``PYTHONPATH`` of ours (the app must see only what the caller adds), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RRTO_")}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


# Local runs started in this process (a test session): (app, flags, whether dumped, the whole
# environment) -> their stdout and the dump file kept for copies.
_LOCAL: dict[tuple, Future[tuple[str, Path | None]]] = {}
_LOCAL_DIR: list[Path] = []
_POOL: list[ThreadPoolExecutor] = []
_DUMPS = itertools.count()  # names of the kept dump files


def _run_local(cmd: list[str], env: dict[str, str], timeout: float,
               kept: Path | None) -> tuple[str, Path | None]:
    out = subprocess.run(cmd, env=env, cwd=APPS, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr[-3000:]}"
    return out.stdout, kept


def start_local(name: str, *flags: str, dump: Path | None = None,
                extra_env: dict[str, str] | None = None, timeout: float = 180,
                background: bool = False) -> Callable[[], str]:
    """Start app ``name`` locally (no offloading) with ``flags`` in ``app_env(**extra_env)``;
    returns a function that waits for it and gives what it printed (and, with ``dump``,
    writes its ``--dump`` file there).

    The apps are deterministic (``appkit``: a seeded model, inputs made per inference from
    their own seeded generator; ``--dump`` only writes the values to a file), so a run with
    the same app, flags and environment as an earlier one in this test session is not made
    again: its stdout is given and its dump file copied. The key is the exact flags and the
    whole environment the process would get, so nothing that could change an output is
    shared. ``background``: the run goes on while the caller runs the same app offloaded,
    under ``nice -n 19``, so that it takes only the CPU the daemons and the offloaded app
    leave idle and their timing stays as it was."""
    env = app_env(**(extra_env or {}))
    key = (name, flags, dump is not None, tuple(sorted(env.items())))
    future = _LOCAL.get(key)
    if future is None:
        cmd = [sys.executable, str(APPS / f"{name}.py"), *flags]
        kept = None
        if dump is not None:
            if not _LOCAL_DIR:
                _LOCAL_DIR.append(Path(tempfile.mkdtemp(prefix="rrto-local-")))
                atexit.register(shutil.rmtree, _LOCAL_DIR[0], True)
            kept = _LOCAL_DIR[0] / f"{next(_DUMPS)}-{name}.json"
            cmd += ["--dump", str(kept)]
        if background and shutil.which("nice"):
            cmd = ["nice", "-n", "19", *cmd]
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(max_workers=2, thread_name_prefix="local-run"))
        future = _LOCAL[key] = _POOL[0].submit(_run_local, cmd, env, timeout, kept)

    def result() -> str:
        try:
            out, kept = future.result()
        except BaseException:
            _LOCAL.pop(key, None)  # not kept: the next caller runs it again
            raise
        if dump is not None and kept is not None:
            shutil.copyfile(kept, dump)
        return out

    return result


def run_local(name: str, *flags: str, dump: Path | None = None,
              extra_env: dict[str, str] | None = None, timeout: float = 180) -> str:
    """``start_local``'s output, waited for: what app ``name`` prints run locally."""
    return start_local(name, *flags, dump=dump, extra_env=extra_env, timeout=timeout)()


def shim_stats(stderr: str) -> dict | None:
    """The shim's counters from an app's stderr (the last ``rrto-stats`` line; None: none, or
    not JSON)."""
    found = None
    for line in stderr.splitlines():
        if line.startswith(STATS_PREFIX):
            try:
                found = json.loads(line.removeprefix(STATS_PREFIX))
            except ValueError:
                found = None
    return found


def compare_outputs(got: str, want: str, tol: float | None = None,
                    got_values: dict[str, list[float]] | None = None,
                    want_values: dict[str, list[float]] | None = None) -> str | None:
    """None when the app printed what the local run printed, else why not. With a tolerance,
    lines may differ in their hash and head values only, and every value within ``tol``."""
    if got == want:
        return None
    if tol is None:
        g, w = got.splitlines(), want.splitlines()
        for k, (a, b) in enumerate(zip(g, w, strict=False)):
            if a != b:
                return f"line {k + 1}: {a!r} != local {b!r}"
        return f"{len(g)} lines != local {len(w)} lines"
    g, w = got.splitlines(), want.splitlines()
    if [_LINE.sub(r"\1", x) for x in g] != [_LINE.sub(r"\1", x) for x in w]:
        return "output names, dtypes or shapes differ from local"
    if got_values is None or want_values is None or got_values.keys() != want_values.keys():
        return "output values missing"
    worst = 0.0
    for k, b in want_values.items():
        a = got_values[k]
        if len(a) != len(b):
            return f"output {k}: {len(a)} values != local {len(b)}"
        worst = max([worst, *(abs(x - y) for x, y in zip(a, b, strict=True))])
    if not worst <= tol:
        return f"values differ from local by up to {worst:.3g} (tolerance {tol:g})"
    return None


def assert_same_as_local(name: str, got: str, want: str, got_dump: Path | None = None,
                         want_dump: Path | None = None) -> None:
    """``compare_outputs`` for app ``name`` with its tolerance; a tolerant app's values come
    from the ``--dump`` files of the two runs."""
    tol = TOLERANCE.get(name)
    values = [json.loads(p.read_text()) if tol is not None and p else None
              for p in (got_dump, want_dump)]
    why = compare_outputs(got, want, tol, *values)
    assert why is None, f"{name}: {why}"


def run_app(name: str, daemon: Any, *flags: str, tmp: Path, tag: str,
            extra_env: dict[str, str] | None = None,
            fallback: str = "error") -> tuple[str, dict]:
    """Run one app offloaded to completion; returns its output lines and its shim stats.
    ``fallback``: the app's ``RRTO_FALLBACK`` (``error``: a host it loses fails the test)."""
    env = app_env(OMP_WAIT_POLICY="PASSIVE", **(extra_env or {}))
    dump = tmp / f"{name}-{tag}.json"
    cmd = [sys.executable, str(APPS / f"{name}.py"), *flags, "--dump", str(dump)]
    env.update(daemon.env, RRTO_STATS="1", RRTO_FALLBACK=fallback)
    cmd = [str(BIN / "rrto-run"), "--", *cmd]
    out = subprocess.run(cmd, env=env, cwd=APPS, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    stats = shim_stats(out.stderr) or {}
    assert stats, out.stderr[-3000:]
    return out.stdout, stats


def same_as_local(name: str, daemon: Any, *flags: str, tmp: Path,
                  extra_env: dict[str, str] | None = None, fallback: str = "error") -> dict:
    """Run app ``name`` offloaded through ``daemon`` and locally; assert both printed the same
    (``assert_same_as_local``) and return the offloaded run's shim stats. The local run goes
    on beside the offloaded one, niced (one made earlier in the session with these flags is
    reused: ``start_local``)."""
    local = start_local(name, *flags, dump=tmp / f"{name}-local.json",
                        extra_env={"OMP_WAIT_POLICY": "PASSIVE"}, background=True)
    got, stats = run_app(name, daemon, *flags, tmp=tmp, tag="remote", extra_env=extra_env,
                         fallback=fallback)
    want = local()
    assert_same_as_local(name, got, want, tmp / f"{name}-remote.json", tmp / f"{name}-local.json")
    return stats
