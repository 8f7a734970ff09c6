"""NTO: the hand-written, non-transparent offloading reference.

What an engineer writes when allowed to change the app: a gRPC server on the host that owns the
model, and a client that ships the input tensor's bytes and receives the outputs' bytes, one
unary call per inference. It runs the same models (``bench.models``, same seed) on the same kind
of device as the GPU daemon, through the same emulated link, so ``rrto/nto`` isolates what
transparency costs.

Wire: method ``/bench.Nto/Infer``, request metadata ``model``, request body the raw float32 input
bytes; response body = 4-byte header length, a JSON header (dtype and shape per output, and the
server's compute time), then the outputs' raw bytes back to back. Raw bytes both ways, no pickle.

``python -m bench.nto serve`` prints ``READY <port>``; ``python -m bench.nto client --model M
--target HOST:PORT`` prints the same JSON line as ``bench/app.py`` plus bytes per inference.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import torch

from bench.models import MODELS, output_digest, outputs_of
from rrtod.grpc_options import CHANNEL_OPTIONS, SERVER_OPTIONS

METHOD = "/bench.Nto/Infer"
# The daemons' own channel and server options (message sizes, keepalive), so NTO is tuned at
# least as well as the peer link it is compared with; the gRPC engine (GRPC_EXPERIMENTS) comes
# from the process environment the harness gives every process of a run.


def encode_outputs(outputs: tuple[torch.Tensor, ...], compute_ms: float = 0.0) -> bytes:
    arrays = [o.contiguous().numpy() for o in outputs]
    header = json.dumps({"outputs": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays],
                         "compute_ms": compute_ms}).encode()
    return b"".join([len(header).to_bytes(4, "big"), header, *(a.tobytes() for a in arrays)])


def decode_outputs(body: bytes) -> tuple[list[torch.Tensor], float]:
    """The outputs, and the server's compute time for them (ms)."""
    n = int.from_bytes(body[:4], "big")
    header = json.loads(body[4:4 + n])
    pos, out = 4 + n, []
    for h in header["outputs"]:
        dtype = np.dtype(h["dtype"])
        count = int(np.prod(h["shape"])) if h["shape"] else 1
        a = np.frombuffer(body, dtype=dtype, count=count, offset=pos).reshape(h["shape"])
        pos += count * dtype.itemsize
        out.append(torch.from_numpy(a.copy()))
    return out, float(header.get("compute_ms", 0.0))


class Server:
    """Serves ``Infer`` for every model in ``bench.models``, building each on first use."""

    def __init__(self, port: int = 0):
        self.models: dict[str, torch.nn.Module] = {}
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
        handler = grpc.method_handlers_generic_handler("bench.Nto", {
            "Infer": grpc.unary_unary_rpc_method_handler(self.infer)})
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def infer(self, body: bytes, context: grpc.ServicerContext) -> bytes:
        name = dict(context.invocation_metadata()).get("model", "")
        spec = MODELS.get(name)
        if spec is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no model {name!r}")
        with self.lock:  # one inference at a time, as the GPU daemon's executor
            model = self.models.get(name)
            if model is None:
                model = self.models[name] = spec.make()
            x = torch.frombuffer(bytearray(body), dtype=torch.float32).reshape(spec.input_shape)
            t0 = time.perf_counter()
            with torch.inference_mode():
                outputs = outputs_of(model(x))
            return encode_outputs(outputs, (time.perf_counter() - t0) * 1e3)

    def stop(self) -> None:
        self.server.stop(0)


def run_client(model: str, target: str, iters: int, warmup: int, budget_s: float | None = None,
               sync: bool = False) -> dict[str, Any]:
    """The hand-written app: same inputs, loop and JSON as bench/app.py, compute on the host."""
    spec = MODELS[model]
    inputs = spec.inputs(warmup + iters)
    digests: list[str] = []
    warm_ms: list[float] = []
    lat_ms: list[float] = []
    cpu_ms: list[float] = []
    spans_ns: list[tuple[int, int]] = []  # CLOCK_MONOTONIC, as the daemon's inference marks
    host_ms: list[float] = []  # the server's compute per inference: the host side of the limit
    up = down = 0
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)
        started = time.perf_counter()
        for i, x in enumerate(inputs):
            if i == warmup:
                if sync:
                    print(json.dumps({"phase": "warm", "warmup_ms": warm_ms}), flush=True)
                    sys.stdin.readline()
                started = time.perf_counter()
                up = down = 0
            c0, m0, t0 = time.process_time(), time.monotonic_ns(), time.perf_counter()
            body = x.contiguous().numpy().tobytes()
            reply = call(body, metadata=(("model", model),), timeout=600)
            outputs, compute_ms = decode_outputs(reply)
            out = [o.numpy().tobytes() for o in outputs]
            t1, m1, c1 = time.perf_counter(), time.monotonic_ns(), time.process_time()
            up, down = up + len(body), down + len(reply)
            digests.append(output_digest(out))
            if i < warmup:
                warm_ms.append((t1 - t0) * 1e3)
                continue
            lat_ms.append((t1 - t0) * 1e3)
            cpu_ms.append((c1 - c0) * 1e3)
            spans_ns.append((m0, m1))
            host_ms.append(compute_ms)
            if budget_s is not None and t1 - started > budget_s:
                break
    n = max(len(lat_ms), 1)
    return {"model": model, "iters": len(lat_ms), "warmup": warmup, "warmup_ms": warm_ms,
            "latency_ms": lat_ms, "cpu_ms": cpu_ms, "digests": digests, "spans_ns": spans_ns,
            "torch_threads": torch.get_num_threads(), "round_trips_per_inference": 1.0,
            "bytes_up_per_inference": up / n, "bytes_down_per_inference": down / n,
            "host_compute_ms": host_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.nto", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, default=0)
    c = sub.add_parser("client")
    c.add_argument("--model", required=True, choices=sorted(MODELS))
    c.add_argument("--target", required=True)
    c.add_argument("--iters", type=int, default=20)
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--budget-s", type=float, default=None)
    c.add_argument("--sync", action="store_true")
    c.add_argument("--sync-end", action="store_true")
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        server = Server(args.port)
        print(f"READY {server.port}", flush=True)
        sys.stdin.read()  # until the harness closes our stdin (or exits)
        server.stop()
        return 0
    print(json.dumps(run_client(args.model, args.target, args.iters, args.warmup, args.budget_s,
                                args.sync)), flush=True)
    if args.sync_end:
        print(json.dumps({"phase": "done"}), flush=True)
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
