"""An unmodified robot app: a camera loop running a small detector on every frame.

Nothing here knows about rrtod. Run it as ``python examples/camera_loop.py`` to compute on this
machine, or as ``rrto-run python examples/camera_loop.py`` to offload the model to a GPU daemon.
It prints one JSON line: frames, latency per frame, and a checksum of every output so that
local and offloaded runs can be compared exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch
from torch import nn


class TinyDetector(nn.Module):
    """A backbone of strided convolutions and a head predicting boxes and class scores."""

    def __init__(self, classes: int = 8):
        super().__init__()
        layers, width = [], 3
        for out in (16, 32, 64, 64):
            layers += [nn.Conv2d(width, out, 3, stride=2, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            width = out
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Conv2d(width, 4 + classes, 1)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.head(self.backbone(image)).flatten(2).transpose(1, 2)
        boxes, scores = out[..., :4], out[..., 4:].sigmoid()
        best, index = scores.max(-1).values.topk(10, dim=-1)
        return boxes.gather(1, index.unsqueeze(-1).expand(-1, -1, 4)), best, index


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--size", type=int, default=160)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyDetector().eval()
    camera = torch.Generator().manual_seed(1)
    digest = hashlib.sha256()
    latencies, cpu = [], []
    with torch.inference_mode():
        for _ in range(args.frames):
            frame = torch.rand(1, 3, args.size, args.size, generator=camera)  # "grab a frame"
            start, start_cpu = time.perf_counter(), time.process_time()
            boxes, scores, index = model((frame - 0.5) / 0.25)
            result = (boxes.numpy().tobytes(), scores.numpy().tobytes(), index.numpy().tobytes())
            latencies.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            for part in result:
                digest.update(part)
    print(json.dumps({
        "frames": args.frames,
        "median_ms": round(statistics.median(latencies) * 1e3, 3),
        "first_ms": round(latencies[0] * 1e3, 3),
        "cpu_ms": round(statistics.median(cpu) * 1e3, 3),  # this process's CPU per frame
        "checksum": digest.hexdigest()[:16],
    }))


if __name__ == "__main__":
    main()
