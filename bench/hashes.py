"""Cost per MB of the weight cache's candidate content hashes (issue 10, finding 6).

    .venv/bin/python -m bench.hashes [--mb 64] [--rounds 7]

Hashes one buffer of random bytes (a weight tensor's size) with each function, interleaved
round by round so that load from other processes hits all alike, and prints the median and the
best ms per MB. xxh3-128 is the old key (fast, not collision-resistant); the cache keeps the
fastest of the collision-resistant ones.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from collections.abc import Callable

import blake3
import xxhash

HASHES: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": lambda b: xxhash.xxh3_128_digest(b),
    "blake3": lambda b: blake3.blake3(b).digest(),
    "sha256": lambda b: hashlib.sha256(b).digest(),
    "blake2b-128": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    data = os.urandom(args.mb << 20)
    times: dict[str, list[float]] = {name: [] for name in HASHES}
    for _ in range(args.rounds):
        for name, fn in HASHES.items():
            start = time.perf_counter()
            fn(data)
            times[name].append((time.perf_counter() - start) * 1e3 / args.mb)
    print(f"{'hash':24} {'median ms/MB':>13} {'best ms/MB':>11}   ({args.mb} MB x {args.rounds})")
    for name, ms in times.items():
        print(f"{name:24} {statistics.median(ms):13.3f} {min(ms):11.3f}")


if __name__ == "__main__":
    main()
