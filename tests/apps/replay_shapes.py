"""Input shapes that change between inferences: six at 32x32, three at 40x40, three at 32x32.
A replayed sequence must never answer the 40x40 calls (their metadata differs): they are
forwarded, and replay resumes when the recorded shape is back."""

import torch
from appkit import main
from torch import nn

SHAPES = [32] * 6 + [40] * 3 + [32] * 3


def build() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(8 * 16, 5))


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + i)
    side = SHAPES[i % len(SHAPES)]
    return torch.randn(1, 3, side, side, generator=g)


if __name__ == "__main__":
    main(build, make_input, mode="no_grad", runs=len(SHAPES))
