"""Figures per cell and across systems: percentiles, ratios, the penalty record/replay removes,
the physical limit and the issue's targets. Pure functions on plain numbers, so they are tested on
synthetic samples and never on timings.
"""

from __future__ import annotations

import math
from typing import Any

# The targets.
RRTO_NTO_MAX = {"robot": 1.05, "loopback": 1.25}
PENALTY_REMOVED_MIN = 0.98
SHIM_US_PER_OP_MAX = 10.0
RATIOS = ("rrto_over_nto", "per_op_over_rrto", "penalty_removed", "rrto_over_local",
          "nto_over_local")


def percentile(samples: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not samples:
        return math.nan
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict[str, float]:
    return {"n": len(samples), "median": percentile(samples, 50), "p90": percentile(samples, 90),
            "p99": percentile(samples, 99), "mean": sum(samples) / len(samples) if samples else math.nan}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def penalty_removed(per_op: float | None, rrto: float | None, nto: float | None) -> float | None:
    """``(per-op − rrto) / (per-op − nto)``: 1 when record/replay is as fast as NTO, 0 when it is
    no better than forwarding every operator. Undefined when per-op is not slower than NTO."""
    if per_op is None or rrto is None or nto is None or per_op <= nto:
        return None
    return (per_op - rrto) / (per_op - nto)


def physical_limit_ms(rtt_ms: float | None, up_mbps: float | None, down_mbps: float | None,
                      bytes_up: float, bytes_down: float, host_compute_ms: float) -> float | None:
    """One round trip, the bytes at the measured rates, and the host's compute: no offloading
    system that ships these bytes can beat this."""
    if rtt_ms is None:
        return None
    t = rtt_ms + host_compute_ms
    if up_mbps:
        t += bytes_up * 8 / (up_mbps * 1e6) * 1e3
    if down_mbps:
        t += bytes_down * 8 / (down_mbps * 1e6) * 1e3
    return t


def comparisons(medians: dict[str, float | None], link_is_robot: bool,
                shim_us_per_op: float | None = None) -> dict[str, Any]:
    """Ratios between systems of one (link, model) and where each target stands."""
    local, nto, per_op, rrto = (medians.get(k) for k in ("local", "nto", "per-op", "rrto"))
    out: dict[str, Any] = {
        "rrto_over_nto": ratio(rrto, nto),
        "per_op_over_rrto": ratio(per_op, rrto),
        "penalty_removed": penalty_removed(per_op, rrto, nto),
        "rrto_over_local": ratio(rrto, local),
        "nto_over_local": ratio(nto, local),
    }
    return _with_targets(out, link_is_robot, shim_us_per_op)


def over_rounds(rounds: list[dict[str, Any]], link_is_robot: bool,
                shim_us_per_op: float | None = None) -> dict[str, Any]:
    """``comparisons`` of one (link, model) measured in rounds (``--rounds``: its systems'
    cells back to back, seconds apart, the order reversed every other round): each ratio is
    the median of the rounds' own ratios, so the machine's drift between rounds (20 % on this
    shared machine between cells minutes apart) does not enter it. Each round's rrto/nto is
    kept beside it (``rrto_over_nto_rounds``): their spread is the figure's own."""
    out: dict[str, Any] = {}
    for key in RATIOS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = percentile(values, 50) if values else None
    out = _with_targets(out, link_is_robot, shim_us_per_op)
    out["rrto_over_nto_rounds"] = [r.get("rrto_over_nto") for r in rounds]
    return out


def _with_targets(out: dict[str, Any], link_is_robot: bool,
                  shim_us_per_op: float | None) -> dict[str, Any]:
    """``out`` (the ratios) with where each target stands."""
    limit = RRTO_NTO_MAX["robot" if link_is_robot else "loopback"]
    targets: dict[str, bool | None] = {
        f"rrto/nto<={limit}": None if out["rrto_over_nto"] is None else out["rrto_over_nto"] <= limit,
    }
    if link_is_robot:
        pr = out["penalty_removed"]
        targets[f"penalty_removed>={PENALTY_REMOVED_MIN}"] = None if pr is None else pr >= PENALTY_REMOVED_MIN
    targets[f"shim_us_per_op<={SHIM_US_PER_OP_MAX:g}"] = (
        None if shim_us_per_op is None else shim_us_per_op <= SHIM_US_PER_OP_MAX)
    out["targets"] = targets
    return out
