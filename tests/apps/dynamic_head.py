"""A detector head whose shapes follow the data: the anchors above a score threshold
(``nonzero``, a boolean mask) differ in number every frame, and so do everything computed
from them and the integers the app derives from their count (``view(n, -1)``, a
``torch.zeros(n, ...)`` of its own). A value read (``bool(...)``) decides nothing here but must
come from the host. Frames alternate between many detections and few.

``--odd-size K``: in inference K the app sizes its own buffer one larger than the count (and
slices it back), so an integer the sequence knows as a size of this inference is not that size:
a forced mismatch, which must be forwarded with the same outputs."""

import sys

import torch
from appkit import main
from torch import nn


class DynamicHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.cls = nn.Conv2d(32, 1, 1)
        self.box = nn.Conv2d(32, 4, 1)
        self.embed = nn.Linear(32, 8)
        self.frame = 0
        argv = sys.argv
        self.odd = int(argv[argv.index("--odd-size") + 1]) if "--odd-size" in argv else -1

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.backbone(x)
        scores = torch.sigmoid(self.cls(f)).flatten()
        boxes = self.box(f).flatten(2).transpose(1, 2).reshape(-1, 4)
        keep = torch.nonzero(scores > 0.5).squeeze(1)  # data-dependent count
        n = keep.shape[0]
        feats = f.flatten(2)[0].t()[keep]
        emb = self.embed(feats.reshape(n, 32))  # an integer that follows the data
        kept = boxes[scores > 0.5]  # a boolean mask
        extra = 1 if self.frame == self.odd else 0
        self.frame += 1
        offsets = torch.full((n + extra, 4), 0.5)[:n]  # made on the host, sized by the count
        confident = bool((scores[keep] > 0.75).any())  # a value read inside the inference
        return {"boxes": kept + offsets, "scores": scores[keep], "emb": emb,
                "confident": torch.tensor([confident])}


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9000 + i)
    return torch.randn(1, 3, 32, 32, generator=g) * (1.0 if i % 2 else 0.2)


if __name__ == "__main__":
    main(DynamicHead, make_input, mode="no_grad", runs=8)
