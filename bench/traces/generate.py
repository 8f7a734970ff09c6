"""Generate the fluctuating-link bandwidth traces reproducibly (fixed seeds, no dependencies).

Why synthetic: the benchmark must run anywhere without fetching measurement data, and the
issue fixes only the statistics: indoor ≈ 93 Mbit/s mean, fluctuating; outdoor ≈ 73 Mbit/s mean
with drops near 0. Both are log-normal AR(1) processes at 100 ms steps (Wi-Fi throughput is
positive, skewed and correlated over seconds); outdoor adds outages (0.3–1.5 s at ~0.2 Mbit/s,
roughly one every 10 s). Each trace is rescaled so its mean is exactly the target.

``python bench/traces/generate.py`` rewrites ``indoor.csv`` and ``outdoor.csv`` beside it.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEP_S = 0.1
DURATION_S = 120.0
DROP_MBPS = 0.2


def ar1_lognormal(rng: random.Random, n: int, phi: float, sigma: float) -> list[float]:
    """exp of an AR(1) process with stationary log-std ``sigma`` and correlation ``phi``/step."""
    x, out = rng.gauss(0.0, sigma), []
    for _ in range(n):
        x = phi * x + sigma * math.sqrt(1 - phi * phi) * rng.gauss(0.0, 1.0)
        out.append(math.exp(x))
    return out


def rescale(values: list[float], mean: float, fixed: set[int] = frozenset()) -> list[float]:
    """Scale the entries not in ``fixed`` so that the mean of all is ``mean``."""
    fixed_sum = sum(values[i] for i in fixed)
    free_sum = sum(v for i, v in enumerate(values) if i not in fixed)
    k = (mean * len(values) - fixed_sum) / free_sum
    return [v if i in fixed else v * k for i, v in enumerate(values)]


def indoor(seed: int = 93) -> list[float]:
    rng = random.Random(seed)
    n = int(DURATION_S / STEP_S)
    return rescale(ar1_lognormal(rng, n, phi=0.9, sigma=0.25), 93.0)


def outdoor(seed: int = 73) -> list[float]:
    rng = random.Random(seed)
    n = int(DURATION_S / STEP_S)
    values = ar1_lognormal(rng, n, phi=0.85, sigma=0.4)
    drops: set[int] = set()
    i = int(rng.expovariate(1 / 10.0) / STEP_S)
    while i < n:
        length = int(rng.uniform(0.3, 1.5) / STEP_S)
        drops.update(range(i, min(n, i + length)))
        i += length + int(rng.expovariate(1 / 10.0) / STEP_S) + 1
    for j in drops:
        values[j] = DROP_MBPS
    return rescale(values, 73.0, drops)


def write(name: str, values: list[float]) -> Path:
    path = HERE / name
    lines = ["time_s,mbps"] + [f"{i * STEP_S:.1f},{v:.3f}" for i, v in enumerate(values)]
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    for name, values in (("indoor.csv", indoor()), ("outdoor.csv", outdoor())):
        path = write(name, values)
        print(f"{path}: {len(values)} steps, mean {sum(values) / len(values):.2f} Mbit/s, "
              f"min {min(values):.2f}, max {max(values):.2f}")


if __name__ == "__main__":
    main()
