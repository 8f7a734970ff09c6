"""A GRU run for a fixed number of steps, feeding its state back (no_grad)."""

import torch
from appkit import inputs, main
from torch import nn


class Rollout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 32, num_layers=2, batch_first=True)
        self.cell = nn.GRUCell(16, 32)
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq, h = self.gru(x)
        step, state = x[:, -1], h[-1]
        for _ in range(5):  # fixed-length autoregressive rollout
            state = self.cell(step, state)
            step = torch.tanh(self.out(state))
        return seq, step


if __name__ == "__main__":
    main(Rollout, inputs(2, 8, 16), mode="no_grad")
