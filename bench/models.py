"""The benchmark's models, in plain torch (no torchvision: it does not import beside torch 2.13),
and the real detectors where their libraries are installed.

Why these: the correctness suite's shapes of computation (MLP policy, small CNN, ResNet-style,
encoder-decoder with upsample+concat, a fixed-step GRU, a transformer block, a detection head
whose post-processing uses sigmoid/top-k/gather and returns several outputs), plus two sizes that
matter on robots: a ResNet-50-sized CNN at 224×224 and a YOLO-style detector with a pose head at
640×640. Weights are seeded so every process (app, NTO server) builds the identical model, and
inputs come from a seeded generator so local and offloaded outputs can be compared exactly.
Only plain aten operators are used (no fused fast paths such as
``torch._transformer_encoder_layer_fwd``), so an interception backend sees ordinary calls.
Where torchvision and Ultralytics are installed, their detection and pose models join
(``bench.detectors``, ``make bench-detection``).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from bench.detectors import SIZE, available
from bench.inputs import INPUTS_ENV


def conv_bn(cin: int, cout: int, k: int = 3, s: int = 1, act: type[nn.Module] = nn.ReLU
            ) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), act())


class MLPPolicy(nn.Module):
    """A control policy: observation vector -> action mean and a squashed action."""

    def __init__(self, obs: int = 64, hidden: int = 256, act: int = 8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.mean = nn.Linear(hidden, act)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.mean(self.body(x))
        return mean, torch.tanh(mean)


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 16), nn.MaxPool2d(2), conv_bn(16, 32), nn.MaxPool2d(2),
                                      conv_bn(32, 64), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1)).softmax(-1)


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.a = conv_bn(cin, cout, 3, stride)
        self.b = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.b(self.a(x)) + self.skip(x))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int):
        super().__init__()
        cout = mid * 4
        self.body = nn.Sequential(conv_bn(cin, mid, 1), conv_bn(mid, mid, 3, stride),
                                  nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """ResNet with basic blocks (ResNet-18 layout) or bottlenecks ([3,4,6,3]: ResNet-50 size)."""

    def __init__(self, layers: tuple[int, ...], bottleneck: bool, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        cin = 64
        for i, n in enumerate(layers):
            width = 64 * 2**i
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                if bottleneck:
                    blocks.append(Bottleneck(cin, width, stride))
                    cin = width * 4
                else:
                    blocks.append(Basic(cin, width, stride))
                    cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


class UNet(nn.Module):
    """Encoder-decoder with skip connections: upsample + concat, a segmentation map out."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.e1, self.e2, self.e3 = conv_bn(3, 16), conv_bn(16, 32, s=2), conv_bn(32, 64, s=2)
        self.d2, self.d1 = conv_bn(64 + 32, 32), conv_bn(32 + 16, 16)
        self.out = nn.Conv2d(16, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.e1(x)
        b = self.e2(a)
        c = self.e3(b)
        d = self.d2(torch.cat([F.interpolate(c, scale_factor=2.0, mode="nearest"), b], 1))
        e = self.d1(torch.cat([F.interpolate(d, scale_factor=2.0, mode="nearest"), a], 1))
        return self.out(e).argmax(1)


class GRUPolicy(nn.Module):
    """A recurrent policy unrolled for a fixed number of steps (the sequence is fixed length)."""

    def __init__(self, inp: int = 32, hidden: int = 128, act: int = 8):
        super().__init__()
        self.cell = nn.GRUCell(inp, hidden)
        self.head = nn.Linear(hidden, act)
        self.hidden = hidden

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.new_zeros(x.shape[0], self.hidden)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h), h


class TransformerBlock(nn.Module):
    """One pre-norm encoder block written out (attention, MLP), then a pooled embedding."""

    def __init__(self, d: int = 128, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.n1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, d))
        x = x + self.mlp(self.n2(x))
        return x.mean(1)


class DetHead(nn.Module):
    """A small detector: strided backbone, box/score head, sigmoid, top-k and gather."""

    def __init__(self, classes: int = 8, k: int = 10):
        super().__init__()
        self.k = k
        self.backbone = nn.Sequential(conv_bn(3, 16, s=2), conv_bn(16, 32, s=2), conv_bn(32, 64, s=2),
                                      conv_bn(64, 64, s=2))
        self.head = nn.Conv2d(64, 4 + classes, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.head(self.backbone(x)).flatten(2).transpose(1, 2)
        boxes, scores = out[..., :4], out[..., 4:].sigmoid()
        best, index = scores.max(-1).values.topk(self.k, dim=-1)
        return boxes.gather(1, index.unsqueeze(-1).expand(-1, -1, 4)), best, index


class C2f(nn.Module):
    """YOLOv8's cross-stage block: split, a chain of residual convs, concat everything."""

    def __init__(self, cin: int, cout: int, n: int = 1):
        super().__init__()
        mid = cout // 2
        self.cv1 = conv_bn(cin, 2 * mid, 1, act=nn.SiLU)
        self.m = nn.ModuleList(nn.Sequential(conv_bn(mid, mid, act=nn.SiLU), conv_bn(mid, mid, act=nn.SiLU))
                               for _ in range(n))
        self.cv2 = conv_bn((2 + n) * mid, cout, 1, act=nn.SiLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            ys.append(ys[-1] + m(ys[-1]))
        return self.cv2(torch.cat(ys, 1))


class YoloPose(nn.Module):
    """A YOLOv8n-pose-sized detector: backbone, FPN/PAN neck (upsample + concat), heads at
    strides 8/16/32 for box, person score and 17 keypoints, then decoding and top-k selection.

    Returns boxes (xyxy pixels), scores, keypoints (x, y, visibility) and the chosen anchors:
    several outputs and real post-processing, as a robot's pose estimator has.
    """

    def __init__(self, width: tuple[int, ...] = (16, 32, 64, 128, 256), kpts: int = 17, k: int = 100):
        super().__init__()
        w = width
        self.kpts, self.k = kpts, k
        self.stem = conv_bn(3, w[0], 3, 2, nn.SiLU)
        self.s2 = nn.Sequential(conv_bn(w[0], w[1], 3, 2, nn.SiLU), C2f(w[1], w[1]))
        self.s3 = nn.Sequential(conv_bn(w[1], w[2], 3, 2, nn.SiLU), C2f(w[2], w[2], 2))  # /8
        self.s4 = nn.Sequential(conv_bn(w[2], w[3], 3, 2, nn.SiLU), C2f(w[3], w[3], 2))  # /16
        self.s5 = nn.Sequential(conv_bn(w[3], w[4], 3, 2, nn.SiLU), C2f(w[4], w[4]))  # /32
        self.up4 = C2f(w[4] + w[3], w[3])
        self.up3 = C2f(w[3] + w[2], w[2])
        self.down4 = nn.Sequential(conv_bn(w[2], w[2], 3, 2, nn.SiLU))
        self.pan4 = C2f(w[2] + w[3], w[3])
        self.down5 = nn.Sequential(conv_bn(w[3], w[3], 3, 2, nn.SiLU))
        self.pan5 = C2f(w[3] + w[4], w[4])
        outs = 4 + 1 + 3 * kpts
        self.heads = nn.ModuleList(nn.Sequential(conv_bn(c, 64, act=nn.SiLU), nn.Conv2d(64, outs, 1))
                                   for c in (w[2], w[3], w[4]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
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
            score = out[:, 4:5].sigmoid()
            kp = out[:, 5:].reshape(b, self.kpts, 3, h * w)
            kxy = (kp[:, :, :2] * 2 - 0.5 + grid.unsqueeze(1)) * stride
            kv = kp[:, :, 2:3].sigmoid()
            boxes = torch.cat([xy - wh / 2, xy + wh / 2], 1)
            kpts = torch.cat([kxy, kv], 2).reshape(b, 3 * self.kpts, h * w)
            preds.append(torch.cat([boxes, score, kpts], 1))
        allp = torch.cat(preds, 2).transpose(1, 2)  # (b, anchors, 5 + 3*kpts)
        scores, index = allp[..., 4].topk(self.k, dim=-1)
        chosen = allp.gather(1, index.unsqueeze(-1).expand(-1, -1, allp.shape[-1]))
        return chosen[..., :4], scores, chosen[..., 5:].reshape(-1, self.k, self.kpts, 3), index




@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    small: bool  # part of the quick subset's candidates; big ones cap iterations

    def make(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        model = self.build().eval()
        # BatchNorm with default statistics is an identity scale; give it seeded, non-trivial
        # statistics so a wrong operator in offloading cannot hide behind x*1+0.
        g = torch.Generator().manual_seed(seed + 1)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
        return model

    def inputs(self, count: int, seed: int = 1) -> list[torch.Tensor]:
        """``count`` fresh deterministic inputs (one per inference): normal noise, or with
        ``RRTO_BENCH_INPUTS=frames`` (``python -m bench --inputs frames``) and an image input
        (N, 3, H, W), 8-bit camera frames as an app normalises them before its model (made
        float and normalised per channel by ImageNet's mean and deviation, as torchvision's
        ``ToTensor`` and ``Normalize`` do)."""
        g = torch.Generator().manual_seed(seed)
        shape = self.input_shape
        if os.environ.get(INPUTS_ENV, "randn") == "frames" and len(shape) == 4 and shape[1] == 3:
            mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
            std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
            return [(torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).float() / 255
                     - mean) / std for _ in range(count)]
        return [torch.randn(shape, generator=g) for _ in range(count)]


MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("mlp", MLPPolicy, (1, 64), True),
    ModelSpec("cnn", SmallCNN, (1, 3, 64, 64), True),
    ModelSpec("resnet18", lambda: ResNet((2, 2, 2, 2), False), (1, 3, 224, 224), False),
    ModelSpec("unet", UNet, (1, 3, 128, 128), True),
    ModelSpec("gru", GRUPolicy, (1, 16, 32), True),
    ModelSpec("transformer", TransformerBlock, (1, 64, 128), True),
    ModelSpec("dethead", DetHead, (1, 3, 160, 160), True),
    ModelSpec("resnet50", lambda: ResNet((3, 4, 6, 3), True), (1, 3, 224, 224), False),
    ModelSpec("yolo-pose", YoloPose, (1, 3, 640, 640), False),
]}
QUICK_MODELS = ("mlp", "cnn", "dethead")
# Real detection and pose models, where torchvision / Ultralytics are installed (bench.detectors).
DETECTION_MODELS = tuple(available())
for _name, _build in available().items():
    MODELS[_name] = ModelSpec(_name, _build, (1, 3, SIZE, SIZE), False)


def outputs_of(result: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A model's result as a tuple of tensors (the app downloads each)."""
    return result if isinstance(result, tuple) else (result,)


def output_digest(parts: list[bytes]) -> str:
    """One inference's outputs as a short hex digest (every byte of every output, in order)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:16]
