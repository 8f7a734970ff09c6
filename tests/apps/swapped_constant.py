"""A model whose forward reads a tensor it recomputes now and then on the offloaded device:
between recomputations the tensor is a constant of the recorded sequence, and after one it is
another tensor of the same shape (new identity, new values)."""

import torch
from appkit import inputs, main
from torch import nn


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.calls = 0
        self.offset: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls % 5 == 0:  # refreshed every 5th inference, computed where the weights are
            self.offset = self.lin.weight.sum(1) * (self.calls + 1)
        self.calls += 1
        return torch.relu(self.lin(x)) + self.offset


if __name__ == "__main__":
    main(Shifted, inputs(1, 16), mode="no_grad", runs=16)
