"""A small CNN classifier under inference_mode, with softmax post-processing."""

import torch
from appkit import inputs, main
from torch import nn


def build() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


if __name__ == "__main__":
    main(build, inputs(2, 3, 32, 32), mode="inference_mode",
         post=lambda y: torch.softmax(y, dim=1))
