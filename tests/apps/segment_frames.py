"""A small segmenter fed camera frames: 8-bit pixels normalised per channel by the app, and per
pixel the class its head scores highest (``argmax``), read back as the app's class map."""

import torch
from appkit import main
from torch import nn

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def frame(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + i)
    pixels = torch.randint(0, 256, (1, 3, 64, 96), dtype=torch.uint8, generator=g)
    return (pixels.float() / 255 - MEAN) / STD


class Segmenter(nn.Module):
    def __init__(self, classes: int = 21):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).argmax(1)  # (1, 64, 96) int64 class map


if __name__ == "__main__":
    main(Segmenter, frame, mode="inference_mode")
