"""A detection head: conv features -> per-anchor scores and boxes, then sigmoid, top-k and
gather post-processing returning several outputs (boxes, scores, classes, a kept count)."""

import torch
from appkit import inputs, main
from torch import nn


class Detector(nn.Module):
    def __init__(self, classes: int = 5, k: int = 10):
        super().__init__()
        self.k, self.classes = k, classes
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.cls = nn.Conv2d(32, classes, 1)
        self.box = nn.Conv2d(32, 4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.backbone(x)
        logits = self.cls(f).flatten(2).transpose(1, 2)  # B, anchors, classes
        boxes = self.box(f).flatten(2).transpose(1, 2)  # B, anchors, 4
        scores, labels = torch.sigmoid(logits).max(dim=2)
        top, idx = scores.topk(self.k, dim=1)
        picked = boxes.gather(1, idx.unsqueeze(-1).expand(-1, -1, 4))
        keep = (top > 0.5).sum(dim=1)
        return {"boxes": picked, "scores": top, "labels": labels.gather(1, idx), "kept": keep}


if __name__ == "__main__":
    main(Detector, inputs(1, 3, 32, 32), mode="no_grad")
