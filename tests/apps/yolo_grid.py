"""A YOLO-style head: the first call builds (and caches) its anchor grid with extra operators,
so the first inference differs from the steady state. The steady-state sequence must still be
found and replayed."""

import torch
from appkit import inputs, main
from torch import nn


class GridHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.SiLU(), nn.Conv2d(8, 16, 3, 2, 1))
        self.pred = nn.Conv2d(16, 6, 1)
        self.grid: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pred(self.backbone(x))  # B, 6, H, W
        b, _, h, w = p.shape
        if self.grid is None:  # built once, on the first inference
            ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            self.grid = torch.stack((xs, ys), 0).float().view(1, 2, h, w)
        xy = (p[:, :2].sigmoid() * 2 - 0.5 + self.grid) * 4
        wh = p[:, 2:4].exp() * 4
        return torch.cat((xy, wh, p[:, 4:].sigmoid()), 1).flatten(2).transpose(1, 2)


if __name__ == "__main__":
    main(GridHead, inputs(1, 3, 32, 32), mode="inference_mode", runs=8)
