"""Run one idiom as an app (the corpus driver's ``module`` for idiom entries):
``python -m compat.idioms.run --entry '{"idiom": "deepcopy_model", ...}' --dump out.npz``.
Same output protocol as compat/app.py: the outputs in an npz, ``MARK`` around the last
``--window`` frames' worth of work is not meaningful here, so marks bracket the whole idiom."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from compat.idioms.apps import IDIOMS, make_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--entry", required=True)
    p.add_argument("--dump", required=True)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--window", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    name = json.loads(args.entry)["idiom"]
    model = make_model()
    start = time.perf_counter()
    outputs = IDIOMS[name](model, args.frames)
    took = time.perf_counter() - start
    arrays = {f"o{i}": torch.as_tensor(o).detach().cpu().numpy() for i, o in enumerate(outputs)}
    np.savez(args.dump, **arrays)
    print("RESULT " + json.dumps({"latency_s": took / max(1, len(outputs)), "input_bytes": 0,
                                  "output_bytes": sum(a.nbytes for a in arrays.values())}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
