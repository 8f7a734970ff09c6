"""Figures for the forwarding path (issue 3): per model, operators per inference, local latency,
``sync`` and ``stream`` forwarded latency on loopback, and the bytes of weights uploaded at the
first run (empty weight cache) and at a restarted run (app and daemon restarted, same state dir).

    .venv/bin/python -m bench.forwarding [--runs 20] [--models resnet,unet]

It starts ``rrtod`` (robot+gpu, loopback) itself, as the tests do, and drives the real shim
client (``SocketChannel`` + the torch interceptor) from this process, one session per model and
mode. A latency is one inference: the model's forward plus downloading all its outputs.
Record/replay is not involved: this measures plain forwarding.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/harness.py: idle spinning

import torch  # noqa: E402

from testkit.apps import APPS  # noqa: E402
from testkit.daemons import Launcher  # noqa: E402

sys.path.insert(0, str(APPS))

import appkit  # noqa: E402


def models() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], Any], str]]:
    import detection
    import gru
    import mlp_policy
    import resnet
    import small_cnn
    import transformer
    import unet
    return {
        "mlp_policy": (mlp_policy.build, appkit.inputs(1, 48), "no_grad"),
        "small_cnn": (small_cnn.build, appkit.inputs(2, 3, 32, 32), "inference_mode"),
        "resnet": (resnet.ResNet, appkit.inputs(1, 3, 64, 64), "grad"),
        "unet": (unet.UNet, appkit.inputs(1, 3, 32, 32), "no_grad"),
        "gru": (gru.Rollout, appkit.inputs(2, 8, 16), "no_grad"),
        "transformer": (transformer.Encoder, appkit.inputs(2, 16, 24), "inference_mode"),
        "detection": (detection.Detector, appkit.inputs(1, 3, 32, 32), "no_grad"),
    }


def timed(model: torch.nn.Module, make: Callable[[int], Any], mode: str, runs: int,
          warmup: int = 2) -> list[float]:
    out = []
    for i in range(warmup + runs):
        x = make(i)
        t0 = time.perf_counter()
        with appkit.MODES[mode]():
            y = model(x)
        for t in appkit.flat(y):
            t.detach().numpy()  # the download the app's next step needs
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def build(fn: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return fn().eval()


def offloaded(sock: str, fn: Callable, make: Callable, mode: str, grad: str,
              runs: int) -> dict[str, Any]:
    from rrto_plugins.torch import make_interceptor
    from rrtod.shim.channel import SocketChannel

    channel = SocketChannel(sock, app="bench-forwarding", pid=os.getpid(), argv=sys.argv)
    try:  # plain forwarding: keep record/replay out of these figures
        itc = make_interceptor(channel, mode=mode, fallback="error", replay=False)
    except TypeError:  # a backend without replay
        itc = make_interceptor(channel, mode=mode, fallback="error")
    try:
        model = build(fn)
        first = timed(model, make, grad, runs=1, warmup=0)[0]  # offload, weights, meta cache
        weights = itc.session.counters["blob_bytes_up"]
        calls0 = itc.session.counters["calls"]
        lat = timed(model, make, grad, runs)
        ops = (itc.session.counters["calls"] - calls0) / (runs + 2)
        return {"first_ms": first, "ms": statistics.median(lat), "ops": ops,
                "weights_up": weights}
    finally:
        itc.uninstall()
        channel.close()
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--models", default="")
    args = p.parse_args(argv)
    table = models()
    names = [m for m in args.models.split(",") if m] or list(table)
    state = Path(tempfile.mkdtemp(prefix="rrto-bench-state-"))
    rows: dict[str, dict[str, Any]] = {n: {} for n in names}
    daemon_env = {"RRTO_OFFLOAD": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    with Launcher(extra_env=daemon_env) as launcher:
        d = launcher.start("bench", state_dir=str(state), log={"format": "json",
                                                               "level": "warning"})
        for n in names:
            fn, make, grad = table[n]
            rows[n]["local_ms"] = statistics.median(timed(build(fn), make, grad, args.runs))
            rows[n]["stream"] = offloaded(d.socket, fn, make, "stream", grad, args.runs)
            rows[n]["sync"] = offloaded(d.socket, fn, make, "sync", grad, args.runs)
        d.stop()
        # Restart the daemon on the same state directory: the weight cache is on disk.
        d2 = launcher.start("bench2", state_dir=str(state), log={"format": "json",
                                                                 "level": "warning"})
        for n in names:
            fn, make, grad = table[n]
            rows[n]["restart"] = offloaded(d2.socket, fn, make, "stream", grad, 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores;"
          f" rrtod robot+gpu on loopback (gRPC), {args.runs} timed inferences, medians")
    print()
    print("| model | ops/inference | local ms | sync ms | stream ms | sync/local | stream/local "
          "| weights up, first run | weights up, restarted app+daemon |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        r = rows[n]
        loc, sy, st = r["local_ms"], r["sync"]["ms"], r["stream"]["ms"]
        print(f"| {n} | {r['stream']['ops']:.0f} | {loc:.2f} | {sy:.2f} | {st:.2f} "
              f"| {sy / loc:.1f}x | {st / loc:.1f}x | {r['stream']['weights_up']:,} B "
              f"| {r['restart']['weights_up']:,} B |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
