"""A fully convolutional net (segmentation-like: the app downloads a map as tall as its input)
whose seventh inference takes another branch halfway through its trunk, decided in Python, not
by a tensor it reads. Split by rows (Hybrid-Parallel), that inference stops matching in the
middle of the split region: the values the robot holds only the first rows of must be put
together from the host's band before the session forwards the rest; the outputs still equal
local execution."""

import torch
from appkit import inputs, main
from torch import nn


def block(cin: int, cout: int, stride: int = 1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.BatchNorm2d(cout), nn.ReLU())


class SplitSwitch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(block(3, 8), block(8, 16, 2))
        self.b, self.c = block(16, 16), nn.Sequential(block(16, 16), nn.MaxPool2d(3, 1, 1))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.head = nn.Conv2d(16, 3, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.a(x)
        h = self.c(h) if self.calls == 7 else self.b(h)
        return self.head(self.up(h)).argmax(1)


if __name__ == "__main__":
    main(SplitSwitch, inputs(1, 3, 40, 32), mode="no_grad", runs=10)
