"""Unix-socket peer link against loopback TCP: what the single-machine default costs or saves.

    .venv/bin/python -m bench.peer [--models mlp,cnn] [--rounds 3] [--iters 50] [--pings 1000]

One GPU daemon serves both its unix peer socket and a loopback TCP port (plaintext, written out:
TLS would add its own cost and is not what the single-machine default replaces). Two robot
daemons offload to it, one over each. Measured, interleaved so that load from other processes on
the machine falls on both alike:

- round trip: a unary ``Ping`` from this process over each address (sync gRPC, ``--pings`` per
  round, alternating), median and p90;
- replayed inference: ``bench.plumbing app`` (plain torch) under ``rrto-run`` against each robot
  daemon, ``--rounds`` times alternating; median and p90 over all steady-state inferences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.plumbing import BIN, ENV, RRTO_ENV, _latencies, _run

PEERS = ("unix", "tcp")


def _stats(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "n": len(ms)}


def ping_ms(address: str, count: int) -> list[float]:
    import grpc

    from rrto.v1 import peer_pb2, peer_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        for _ in range(20):  # connect and warm up
            stub.Ping(peer_pb2.PingRequest(), timeout=10)
        out = []
        for _ in range(count):
            t = time.perf_counter_ns()
            stub.Ping(peer_pb2.PingRequest(sent_ns=t), timeout=10)
            out.append((time.perf_counter_ns() - t) / 1e6)
    return out


def run(models: list[str], rounds: int, iters: int, warmup: int, pings: int) -> dict[str, Any]:
    from testkit.daemons import Launcher

    results: dict[str, Any] = {"rounds": rounds, "iters": iters, "pings": pings, "ping": {},
                               "models": {}}
    with Launcher(extra_env=ENV) as launcher:
        gpu = launcher.start("gpu", roles=["gpu"])  # TCP listen, tls insecure (testkit/daemons.py)
        addresses = {"tcp": gpu.listen, "unix": f"unix:{Path(gpu.socket).parent / 'peer.sock'}"}
        robots = {p: launcher.start(f"robot-{p}", roles=["robot"],
                                    hosts=[{"name": "gpu", "address": addresses[p]}])
                  for p in PEERS}
        for robot in robots.values():
            robot.wait_for(lambda s: s["hosts"][0]["state"] == "up", what="GPU host up")
        rtts: dict[str, list[float]] = {p: [] for p in PEERS}
        for _ in range(rounds):
            for p in PEERS:
                rtts[p] += ping_ms(addresses[p], pings)
        results["ping"] = {p: _stats(v) for p, v in rtts.items()}
        for m in models:
            lat: dict[str, list[float]] = {p: [] for p in PEERS}
            for _ in range(rounds):
                for p in PEERS:
                    cmd = [str(BIN / "rrto-run"), sys.executable, "-m", "bench.plumbing", "app",
                           "--model", m, "--iters", str(iters), "--warmup", str(warmup)]
                    out, _ = _run(cmd, {**robots[p].env, **RRTO_ENV})
                    lat[p] += _latencies(out)
            results["models"][m] = {p: _stats(v) for p, v in lat.items()}
    return results


def report(r: dict[str, Any]) -> str:
    lines = ["| measure | unix peer ms (median / p90) | loopback TCP ms (median / p90) | unix − tcp |",
             "|---|---|---|---|"]
    rows = [("gRPC unary Ping round trip", r["ping"])]
    rows += [(f"replayed inference, {m}", v) for m, v in r["models"].items()]
    for name, v in rows:
        u, t = v["unix"], v["tcp"]
        lines.append(f"| {name} | {u['median_ms']:.3f} / {u['p90_ms']:.3f} | "
                     f"{t['median_ms']:.3f} / {t['p90_ms']:.3f} | "
                     f"{u['median_ms'] - t['median_ms']:+.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.peer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--pings", type=int, default=1000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    results = run(args.models.split(","), args.rounds, args.iters, args.warmup, args.pings)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
