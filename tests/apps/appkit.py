"""Shared scaffolding of the test apps: plain PyTorch, no rrto import anywhere.

Each app builds a seeded model, runs a few inferences on deterministic inputs and prints, per
output tensor, its dtype, shape, a SHA-256 of its bytes and a few values. The same script run
locally and under ``rrto-run`` must print the same lines. ``--hold`` keeps the process (and so
its offloading session) alive until a line arrives on stdin, so a test can ask the daemon for
the session's operator count; ``--thread`` runs the inferences in a thread the app starts;
``--hold-mid`` waits for a line after the first half of the inferences (a test stops the GPU
host there); ``--dump FILE`` writes every output's values as JSON (for the transformer's tolerance check);
``--runs N`` runs N inferences instead of the app's default; ``--pace MS`` sleeps MS after each
inference, as a sensor-paced robot loop does; ``--until-stdin`` goes on after those until a line
arrives on stdin (a camera loop that a test stops once it has seen what it waits for);
``--times FILE`` writes, per inference, its start (CLOCK_MONOTONIC, comparable across processes)
and its seconds from the model call to the last output read, as JSON; ``--schedule FILE``: after
the first ``--runs`` inferences (a warm-up) prints their lines and ``SCHEDULE``, waits for a line
on stdin, then reads FILE, a JSON list of CLOCK_MONOTONIC times, and starts one more inference at
each (at once when the previous one ended later): requests arriving open-loop at a load
profile's times, as frames from a sensor do.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

MODES = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "grad": torch.enable_grad,  # eval with autograd on: outputs carry grad_fn
}


def flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in flat(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat(v)]
    return []


def describe(index: int, outputs: Any) -> list[str]:
    lines = []
    for k, t in enumerate(flat(outputs)):
        data = t.detach().contiguous().numpy()  # a data read: downloads a proxy
        digest = hashlib.sha256(data.tobytes()).hexdigest()[:16]
        head = [round(float(v), 6) for v in t.detach().flatten()[:3].tolist()]
        lines.append(f"{index}:{k} {str(t.dtype)[6:]} {list(t.shape)} {digest} {head}")
    return lines


def main(build: Callable[[], torch.nn.Module], make_input: Callable[[int], Any],
         mode: str = "no_grad", runs: int = 3,
         post: Callable[[Any], Any] | None = None) -> None:
    argv = sys.argv[1:]
    if "--runs" in argv:  # more inferences than the app's default (record/replay tests)
        runs = int(argv[argv.index("--runs") + 1])
    torch.manual_seed(0)
    model = build().eval()
    lines: list[str] = []

    dumped: dict[str, list] = {}
    times: list[tuple[float, float]] = []  # per inference: start (CLOCK_MONOTONIC), seconds

    stop = threading.Event()
    if "--until-stdin" in argv:  # at least ``runs`` inferences, then until a line arrives
        threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()

    def infer() -> None:
        i = 0
        while i < runs or ("--until-stdin" in argv and not stop.is_set()):
            if "--hold-mid" in argv and i == runs // 2:
                print("\n".join(lines), flush=True)
                lines.clear()
                print("HOLD", flush=True)
                sys.stdin.readline()
            one(i)
            i += 1
        if "--schedule" in argv:  # then one inference at each time of the schedule
            print("\n".join(lines), flush=True)
            lines.clear()
            print("SCHEDULE", flush=True)
            sys.stdin.readline()
            with open(argv[argv.index("--schedule") + 1]) as f:
                schedule = [float(t) for t in json.load(f)]
            for at in schedule:
                wait = at - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                one(i)
                i += 1

    def one(i: int) -> None:
        """One inference: input ("grab a frame", untimed), model, every output read."""
        x = make_input(i)
        began = time.monotonic()
        with MODES[mode]():
            out = model(*x) if isinstance(x, tuple) else model(x)
            if post is not None:
                out = post(out)
        lines.extend(describe(i, out))
        times.append((began, time.monotonic() - began))
        if "--pace" in argv:  # a sensor-paced loop: ms between inferences
            time.sleep(float(argv[argv.index("--pace") + 1]) / 1000)
        if "--dump" in argv:
            for k, t in enumerate(flat(out)):
                dumped[f"{i}:{k}"] = t.detach().double().flatten().tolist()

    if "--thread" in argv:
        t = threading.Thread(target=infer)
        t.start()
        t.join()
    else:
        infer()
    print("\n".join(lines), flush=True)
    if "--dump" in argv:
        with open(argv[argv.index("--dump") + 1], "w") as f:
            json.dump(dumped, f)
    if "--times" in argv:
        with open(argv[argv.index("--times") + 1], "w") as f:
            json.dump(times, f)
    if "--hold" in argv:
        print("HOLD", flush=True)
        sys.stdin.readline()


def inputs(*shape: int, seed: int = 1) -> Callable[[int], torch.Tensor]:
    """Deterministic inputs, different for each inference (made with plain local torch)."""
    def make(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1000 + i)
        return torch.randn(*shape, generator=g)
    return make
