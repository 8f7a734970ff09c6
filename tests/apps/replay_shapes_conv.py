"""A fully-convolutional model whose output shape follows its input: six inferences at 32x32,
three at 40x40, three at 32x32. Unlike ``replay_shapes`` (whose fixed-size pooling makes every
input give the same output shape), replaying a 32x32 sequence for a 40x40 input cannot come out
right: the recorded shapes no longer fit (the final flatten's recorded size, say). So the 40x40
calls must be recognised as different and forwarded, and replay must resume with 32x32."""

import torch
from appkit import main
from torch import nn

SHAPES = [32] * 6 + [40] * 3 + [32] * 3


def build() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.Sigmoid(), nn.Flatten(0))


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7100 + i)
    side = SHAPES[i % len(SHAPES)]
    return torch.randn(1, 3, side, side, generator=g)


if __name__ == "__main__":
    main(build, make_input, mode="no_grad", runs=len(SHAPES))
