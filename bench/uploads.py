"""``python -m bench.uploads``: what a replayed input costs to put on the wire, raw and
palette-coded (``rrto_plugins.torch.codec.palette_of``), per frame size and preprocessing.

A robot app that scales or normalises its 8-bit camera frame before the model uploads floats:
four bytes a pixel channel where one would do. The shim codes such a frame with a palette
(``TensorData.palette``); this reports, per case, the bytes each way, the shim's CPU to encode
(``codec.replay_upload``: the coding and its check, or the raw frame when the data is not on a
palette), the host's CPU to decode (``codec.from_tensor_data``), all measured here on one
thread (medians over ``--repeat`` rounds); and, as arithmetic only (bytes saved x 8 / rate),
what the bytes saved would take at a few nominal link rates. The end-to-end effect on an
emulated link is measured by ``python -m bench --inputs frames`` (docs/benchmark.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
# Preprocessing as apps write it, from an 8-bit frame; "float data" is not on any palette.
CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "scaled /255": lambda px: px.float() / 255,
    "normalised (mean, std)": lambda px: (px.float() / 255 - MEAN) / STD,
    "float data": lambda px: torch.rand(px.shape, generator=torch.Generator().manual_seed(0)),
}
RATES_MBIT = (50, 100, 450)


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(height: int, width: int, repeat: int) -> list[dict]:
    pixels = torch.randint(0, 256, (1, 3, height, width), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    rows = []
    for name, prepare in CASES.items():
        t = prepare(pixels)
        raw = t.numel() * t.element_size()
        frame = codec.replay_upload(0, t, {})
        wire = frame.SerializeToString()
        data = ops_pb2.SessionUp.FromString(wire).arg.tensor.upload
        encode_ms = _median_ms(lambda t=t: codec.replay_upload(0, t, {}), repeat)
        decode_ms = _median_ms(lambda data=data: codec.from_tensor_data(data), repeat)
        saved = raw - (len(data.data) + len(data.palette))
        rows.append({
            "frame": f"{height}x{width}", "input": name, "raw_bytes": raw,
            "wire_bytes": len(data.data) + len(data.palette), "coded": bool(data.palette),
            "encode_ms": round(encode_ms, 3), "decode_ms": round(decode_ms, 3),
            "saved_link_ms": {r: round(saved * 8 / (r * 1e3), 2) for r in RATES_MBIT},
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128x128,480x640,640x640")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for size in args.sizes.split(",")
            for row in measure(*map(int, size.split("x")), args.repeat)]
    if args.json:
        print(json.dumps({"torch": torch.__version__, "rows": rows}))
        return
    rates = " | ".join(f"link ms saved at {r} Mbit/s" for r in RATES_MBIT)
    print(f"| frame | input | raw KB | wire KB | encode ms | decode ms | {rates} |")
    print("|---|---|---|---|---|---|" + "---|" * len(RATES_MBIT))
    for r in rows:
        saved = " | ".join(str(r["saved_link_ms"][k]) for k in RATES_MBIT)
        print(f"| {r['frame']} | {r['input']} | {r['raw_bytes'] / 1e3:.1f} | "
              f"{r['wire_bytes'] / 1e3:.1f} | {r['encode_ms']} | {r['decode_ms']} | {saved} |")


if __name__ == "__main__":
    main()
