"""Data-dependent control flow: the branch taken depends on a value computed from the input
(a download inside the inference). Whenever it differs from the recorded one, the replay
mismatches at the first differing call; the outputs must still equal local execution.

``--rewrite K``: in frame K the model scales its output in place after its last call (a call
no frame before made, after the replayed inference ended): the host pushed the output before
that, and the app's read must see the scaled value."""

import sys

import torch
from appkit import main
from torch import nn

# The sign of each input's mean: runs of the same branch, then changes.
SIGNS = [1, 1, 1, 1, -1, 1, 1, 1, -1, -1, 1, 1]
REWRITE = int(sys.argv[sys.argv.index("--rewrite") + 1]) if "--rewrite" in sys.argv else -1


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.pos = nn.Sequential(nn.ReLU(), nn.Linear(32, 8))
        self.neg = nn.Sequential(nn.Tanh(), nn.Linear(32, 8), nn.Sigmoid())
        self.frame = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.frame += 1
        h = self.stem(x)
        out = self.pos(h) if x.mean() > 0 else self.neg(h)
        if self.frame == REWRITE:
            out.mul_(2)
        return out


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(8000 + i)
    return torch.randn(2, 16, generator=g).abs() * SIGNS[i % len(SIGNS)]


if __name__ == "__main__":
    main(Branchy, make_input, mode="no_grad", runs=len(SIGNS))
