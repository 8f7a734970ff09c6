"""What the host's memory-safety checks cost per replayed inference (issue 10).

    .venv/bin/python -m bench.memcheck [--model resnet18] [--rounds 7] [--iters 20]

Records the aten operators of one inference of a bench model (``no_grad``, as apps run), then,
on this machine, measures per inference and per operator:

- ``forward``: the inference itself, plain torch (what a replay spends in the operators);
- ``bounds``: ``check_view`` on every output of every operator (the output bound check);
- ``sizes``: the replay path's size lookup, ``PreparedCall.size_key`` of the operator's tensor
  arguments and the dictionary hit (meta execution happens once per metadata, not here).

Rounds interleave the three measurements (the machine is shared); medians are reported, with
both checks as a share of the forward.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.models import MODELS
from rrto_plugins.torch.bounds import check_view
from rrto_plugins.torch.prepared import PreparedCall


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor)]
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        self.calls.append((ins, outs))
        return out


def _per_iter(fn: Any, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    spec = MODELS[a.model]
    model = spec.make().eval()
    x = torch.randn(*spec.input_shape)
    with torch.no_grad():
        model(x)
        rec = _Record()
        with rec:
            model(x)
    calls = rec.calls
    outs = [t for _, o in calls for t in o]
    memo: dict[int, dict[Any, int]] = {}
    for k, (ins, _) in enumerate(calls):
        memo[k] = {PreparedCall.size_key(ins): 0}

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def bounds() -> None:
        for t in outs:
            check_view(t, "bench")

    def sizes() -> None:
        for k, (ins, _) in enumerate(calls):
            memo[k].get(PreparedCall.size_key(ins))

    res: dict[str, list[float]] = {"forward": [], "bounds": [], "sizes": []}
    for _ in range(a.rounds):
        res["forward"].append(_per_iter(forward, max(1, a.iters // 4)))
        res["bounds"].append(_per_iter(bounds, a.iters * 10))
        res["sizes"].append(_per_iter(sizes, a.iters * 10))
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{a.model}: {len(calls)} operators, {len(outs)} outputs per inference "
          f"({torch.get_num_threads()} threads, {a.rounds} interleaved rounds, medians)")
    print(f"  forward  {med['forward'] * 1e3:8.2f} ms")
    for k in ("bounds", "sizes"):
        print(f"  {k:7}  {med[k] * 1e6:8.1f} us per inference = "
              f"{med[k] / med['forward'] * 100:.2f} % of the forward, "
              f"{med[k] / len(calls) * 1e6:.2f} us per operator "
              f"(min {min(res[k]) / len(calls) * 1e6:.2f}, max {max(res[k]) / len(calls) * 1e6:.2f})")


if __name__ == "__main__":
    main()
