"""The benchmark's app: an unmodified inference loop, as a robot program would run it.

Nothing here knows about rrtod: ``python bench/app.py --model NAME`` computes locally,
``rrto-run python bench/app.py --model NAME`` offloads it transparently. Each inference takes a
fresh deterministic input ("grab a frame", untimed), runs the model in ``inference_mode`` and
reads every output back as bytes (timed: the app needs its results). It prints ONE JSON line:
per-inference latency (perf_counter) and process CPU time (process_time), warm-up latencies
apart, and a digest of every inference's outputs (warm-up and measured) so the harness compares
each one with local execution: an offloading bug that shows only from the n-th inference on
(stale outputs, say) cannot hide behind a correct prefix.

``--sync`` lets the harness read the daemon's counters at the end of the warm-up: the app prints
``{"phase": "warm"}`` and waits for a line on stdin; ``--sync-end`` does the same (``done``) after
the result line, while the session is still open. ``--budget-s`` stops measuring early (the
JSON says how many inferences ran) so a slow system cannot stall the whole benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import torch  # noqa: E402

from bench.models import MODELS, output_digest, outputs_of  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/app.py", description=__doc__)
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None, help="stop measuring after this")
    parser.add_argument("--sync", action="store_true", help="wait for stdin after the warm-up")
    parser.add_argument("--sync-end", action="store_true", help="and again after the result line")
    parser.add_argument("--values", type=Path, default=None,
                        help="append every inference's outputs here (float64), to compare "
                        "within a tolerance where a system is not bit-exact by design")
    args = parser.parse_args(argv)
    spec = MODELS[args.model]
    model = spec.make()
    inputs = spec.inputs(args.warmup + args.iters)
    digests: list[str] = []
    warm_ms: list[float] = []
    lat_ms: list[float] = []
    cpu_ms: list[float] = []
    spans_ns: list[tuple[int, int]] = []  # CLOCK_MONOTONIC, as the daemon's inference marks
    started = time.perf_counter()
    values = args.values.open("wb") if args.values is not None else None
    with torch.inference_mode():
        for i, x in enumerate(inputs):
            if i == args.warmup:
                if args.sync:
                    print(json.dumps({"phase": "warm", "warmup_ms": warm_ms}), flush=True)
                    sys.stdin.readline()
                started = time.perf_counter()
            c0, m0, t0 = time.process_time(), time.monotonic_ns(), time.perf_counter()
            result = outputs_of(model(x))
            out = [o.numpy().tobytes() for o in result]
            t1, m1, c1 = time.perf_counter(), time.monotonic_ns(), time.process_time()
            digests.append(output_digest(out))
            if values is not None:  # untimed: after the app has its results
                values.write(torch.cat([o.detach().double().flatten() for o in result])
                             .numpy().tobytes())
            if i < args.warmup:
                warm_ms.append((t1 - t0) * 1e3)
                continue
            lat_ms.append((t1 - t0) * 1e3)
            cpu_ms.append((c1 - c0) * 1e3)
            spans_ns.append((m0, m1))
            if args.budget_s is not None and t1 - started > args.budget_s:
                break
    if values is not None:
        values.close()
    print(json.dumps({"model": args.model, "iters": len(lat_ms), "warmup": args.warmup,
                      "warmup_ms": warm_ms, "latency_ms": lat_ms, "cpu_ms": cpu_ms,
                      "digests": digests, "spans_ns": spans_ns,
                      "torch_threads": torch.get_num_threads()}), flush=True)
    if args.sync_end:
        print(json.dumps({"phase": "done"}), flush=True)
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
