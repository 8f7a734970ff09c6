"""Per-class post-processing, as torchvision's ``batched_nms`` runs it on many boxes: a loop
over the classes present (``for c in torch.unique(labels)``: a count the data decides, each
iteration a different item of the unbound classes), each selecting its boxes (``nonzero``)
and marking the confident ones in a mask the loop fills (``keep[idx[s > 0.5]] = True``)."""

import torch
from appkit import main
from torch import nn


class ClassLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU())
        self.cls = nn.Conv2d(16, 6, 1)
        self.score = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.backbone(x)
        scores = torch.sigmoid(self.score(f)).flatten()
        labels = self.cls(f).flatten(2)[0].argmax(0)
        keep = torch.zeros_like(scores, dtype=torch.bool)
        for c in torch.unique(labels):  # the classes present: a count the data decides
            idx = torch.where(labels == c)[0]
            s = scores[idx]
            keep[idx[s > 0.5]] = True  # a count the data decides, as nms keeps
        kept = torch.where(keep)[0]
        return kept, scores[kept]


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + i)
    return torch.randn(1, 3, 8, 8, generator=g) * (1.0 + 0.3 * (i % 3))


if __name__ == "__main__":
    main(ClassLoop, make_input, mode="no_grad", runs=8)
