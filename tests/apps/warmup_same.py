"""A policy warmed up on one dummy observation before the real ones: the first inferences all
have the same input bytes, so a sequence recorded then sees a small input that never changed
(``SeqSource.fixed``). The real observations that follow must not be answered with the dummy:
the first is a mismatch (forwarded, equal to local), the sequence is given up and the app
replays again once its real inputs are recorded."""

import torch
from appkit import main
from torch import nn

WARMUP = 4


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).softmax(-1)


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0 if i < WARMUP else 5000 + i)
    return torch.randn(1, 16, generator=g)


if __name__ == "__main__":
    main(Policy, make_input, mode="no_grad", runs=14)
