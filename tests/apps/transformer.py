"""A transformer encoder block at a fixed sequence length (inference_mode)."""

import torch
from appkit import inputs, main
from torch import nn


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(24, 64)
        self.pos = nn.Parameter(torch.randn(1, 16, 64) * 0.02)
        self.block = nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0,
                                                batch_first=True)
        self.norm = nn.LayerNorm(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.block(self.embed(x) + self.pos)).mean(dim=1)


if __name__ == "__main__":
    main(Encoder, inputs(2, 16, 24), mode="inference_mode")
