"""The app changes model halfway: six inferences of one network, then eight of another with
the same first operator. The first sequence stops matching; the session must record again and
find the second model's sequence."""

import torch
from appkit import inputs, main
from torch import nn


class Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))
        self.b = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 20), nn.ReLU(),
                               nn.Linear(20, 3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.a(x) if self.calls <= 6 else self.b(x)


if __name__ == "__main__":
    main(Switch, inputs(4, 12), mode="no_grad", runs=14)
