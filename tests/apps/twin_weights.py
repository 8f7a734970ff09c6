"""Two copies of one network (same weights, other tensors: a model and its deep copy made
before offloading), used in turn after the first inferences. Every weight of one matches the
recorded sequence's weights of the other by content hash, so the replay rebinds them: the host
runs ahead on its bindings, so a rebind after a replay's first call must be a mismatch, never a
late argument (that raised ``NO_REPLAY: replay argument outside a replay`` in the app)."""

import copy

import torch
from appkit import inputs, main
from torch import nn


class Twins(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.b = copy.deepcopy(self.a)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        net = self.b if self.calls > 5 and self.calls % 2 else self.a
        return net(x)


if __name__ == "__main__":
    main(Twins, inputs(1, 16), mode="no_grad", runs=12)
