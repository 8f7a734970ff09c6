"""An encoder-decoder with upsampling and skip concatenation (FPN/UNet-like), no_grad."""

import torch
import torch.nn.functional as F
from appkit import inputs, main
from torch import nn


def block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e1, self.e2, self.e3 = block(3, 8), block(8, 16), block(16, 32)
        self.d2, self.d1 = block(32 + 16, 16), block(16 + 8, 8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.e1(x)
        s2 = self.e2(F.max_pool2d(s1, 2))
        b = self.e3(F.max_pool2d(s2, 2))
        u2 = F.interpolate(b, scale_factor=2, mode="nearest")
        y = self.d2(torch.cat([u2, s2], dim=1))
        u1 = F.interpolate(y, size=s1.shape[-2:], mode="bilinear", align_corners=False)
        return self.head(self.d1(torch.cat([u1, s1], dim=1)))


if __name__ == "__main__":
    main(UNet, inputs(1, 3, 32, 32), mode="no_grad")
