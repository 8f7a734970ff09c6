"""A small CNN fed camera frames as a robot app grabs them: 8-bit RGB pixels, made float and
normalised per channel by a mean and deviation on the robot (as torchvision's ``ToTensor`` and
``Normalize`` do) before the model sees them."""

import torch
from appkit import main
from torch import nn

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def frame(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    pixels = torch.randint(0, 256, (1, 3, 48, 64), dtype=torch.uint8, generator=g)
    return (pixels.float() / 255 - MEAN) / STD


def build() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
        nn.Flatten(), nn.Linear(8 * 12 * 16, 10),
    )


if __name__ == "__main__":
    main(build, frame, mode="inference_mode")
