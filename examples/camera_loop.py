"""An unmodified robot app: a camera loop running an object detector on every VGA frame.

Nothing here knows about rrtod. Run it as ``python examples/camera_loop.py`` to compute on this
machine, or as ``rrto-run python examples/camera_loop.py`` to offload the model to a GPU daemon.

The detector is YOLOv8n-sized (a CSP backbone, an FPN/PAN neck, heads at strides 8/16/32, box
decoding and top-100 selection; random weights, nothing is downloaded) and takes the camera's
640x480 uint8 frame as it comes: scaling to [0, 1] is the model's first step, as in many
deployed detectors, so only the raw frame has to travel when the model runs elsewhere.

It prints one JSON line: per-frame latency and CPU time, the loop's frame rate, when each
inference started and ended (CLOCK_MONOTONIC, so an outside power meter can attribute energy to
frames), the bytes of each frame's input and outputs, and a digest of every frame's outputs so
that local and offloaded runs can be compared frame by frame (``--save`` keeps the outputs too,
for comparing runs on hardware that rounds differently).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


def conv(cin: int, cout: int, k: int = 3, s: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), nn.SiLU())


class C2f(nn.Module):
    """YOLOv8's cross-stage block: split, a chain of residual convs, concatenate everything."""

    def __init__(self, cin: int, cout: int, n: int = 1):
        super().__init__()
        mid = cout // 2
        self.cv1 = conv(cin, 2 * mid, 1)
        self.m = nn.ModuleList(nn.Sequential(conv(mid, mid), conv(mid, mid)) for _ in range(n))
        self.cv2 = conv((2 + n) * mid, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            ys.append(ys[-1] + m(ys[-1]))
        return self.cv2(torch.cat(ys, 1))


class Detector(nn.Module):
    """Boxes (xyxy pixels), scores and classes of the ``k`` best anchors of a uint8 RGB frame."""

    def __init__(self, classes: int = 80, k: int = 100, w: tuple[int, ...] = (16, 32, 64, 128, 256)):
        super().__init__()
        self.classes, self.k = classes, k
        self.register_buffer("scale", torch.tensor(1 / 255))  # uint8 pixels -> [0, 1]
        self.stem = conv(3, w[0], 3, 2)
        self.s2 = nn.Sequential(conv(w[0], w[1], 3, 2), C2f(w[1], w[1]))
        self.s3 = nn.Sequential(conv(w[1], w[2], 3, 2), C2f(w[2], w[2], 2))  # stride 8
        self.s4 = nn.Sequential(conv(w[2], w[3], 3, 2), C2f(w[3], w[3], 2))  # stride 16
        self.s5 = nn.Sequential(conv(w[3], w[4], 3, 2), C2f(w[4], w[4]))  # stride 32
        self.up4, self.up3 = C2f(w[4] + w[3], w[3]), C2f(w[3] + w[2], w[2])
        self.down4, self.pan4 = conv(w[2], w[2], 3, 2), C2f(w[2] + w[3], w[3])
        self.down5, self.pan5 = conv(w[3], w[3], 3, 2), C2f(w[3] + w[4], w[4])
        self.heads = nn.ModuleList(nn.Sequential(conv(c, 64), nn.Conv2d(64, 4 + classes, 1))
                                   for c in (w[2], w[3], w[4]))

    def forward(self, frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = frame * self.scale  # uint8 * float32 -> float32
        p3 = self.s3(self.s2(self.stem(x)))
        p4 = self.s4(p3)
        p5 = self.s5(p4)
        n4 = self.up4(torch.cat([F.interpolate(p5, scale_factor=2.0, mode="nearest"), p4], 1))
        n3 = self.up3(torch.cat([F.interpolate(n4, scale_factor=2.0, mode="nearest"), p3], 1))
        m4 = self.pan4(torch.cat([self.down4(n3), n4], 1))
        m5 = self.pan5(torch.cat([self.down5(m4), p5], 1))
        preds = []
        for feat, head, stride in zip((n3, m4, m5), self.heads, (8, 16, 32), strict=True):
            out = head(feat)
            b, c, h, w = out.shape
            gy, gx = torch.meshgrid(torch.arange(h, dtype=out.dtype), torch.arange(w, dtype=out.dtype),
                                    indexing="ij")
            grid = torch.stack([gx, gy], 0).reshape(1, 2, h * w)
            out = out.reshape(b, c, h * w)
            xy = (out[:, 0:2].sigmoid() * 2 - 0.5 + grid) * stride
            wh = (out[:, 2:4].sigmoid() * 2) ** 2 * stride * 4
            preds.append(torch.cat([xy - wh / 2, xy + wh / 2, out[:, 4:].sigmoid()], 1))
        allp = torch.cat(preds, 2).transpose(1, 2)  # (batch, anchors, 4 + classes)
        best, cls = allp[..., 4:].max(-1)
        scores, index = best.topk(self.k, dim=-1)
        boxes = allp[..., :4].gather(1, index.unsqueeze(-1).expand(-1, -1, 4))
        return boxes, scores, cls.gather(1, index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=20)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--save", help="also write every frame's outputs to this file (torch.save)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Detector().eval()
    stats = torch.Generator().manual_seed(1)  # BatchNorm statistics that are not an identity
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=stats) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=stats) + 0.5)
    camera = torch.Generator().manual_seed(2)
    latency_ms, cpu_ms, spans_ns, digests, saved = [], [], [], [], []
    in_bytes = out_bytes = 0
    loop_start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(args.frames):
            frame = torch.randint(0, 256, (1, 3, args.height, args.width), dtype=torch.uint8,
                                  generator=camera)  # "grab a frame"
            start, start_cpu, start_ns = time.perf_counter(), time.process_time(), time.monotonic_ns()
            outputs = [t.numpy() for t in model(frame)]  # the app reads every output
            result = [o.tobytes() for o in outputs]
            latency_ms.append((time.perf_counter() - start) * 1e3)
            cpu_ms.append((time.process_time() - start_cpu) * 1e3)
            spans_ns.append((start_ns, time.monotonic_ns()))
            digests.append(hashlib.sha256(b"".join(result)).hexdigest()[:16])
            in_bytes, out_bytes = frame.numel() * frame.element_size(), sum(map(len, result))
            if args.save:
                saved.append([torch.from_numpy(o.copy()) for o in outputs])
    loop_s = time.perf_counter() - loop_start
    if args.save:
        torch.save(saved, args.save)
    print(json.dumps({
        "frames": args.frames, "latency_ms": latency_ms, "cpu_ms": cpu_ms, "spans_ns": spans_ns,
        "loop_s": loop_s, "fps": args.frames / loop_s, "digests": digests,
        "input_bytes": in_bytes, "output_bytes": out_bytes, "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
