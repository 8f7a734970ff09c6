"""Frames with and without detections, in irregular runs: the head returns early when nothing
is above the threshold (``if keep.numel() == 0``, as torchvision's and Ultralytics' post-
processing do), so the same loop has two operator sequences that share their first calls and
branch on a count only the data decides. The robot records the second as a variant of the
first (the calls replayed before the branch go into its log), the shim switches to whichever
matches at the branch, and once both are known neither is recorded again."""

import torch
from appkit import main
from torch import nn

# S: some detections, N: none.
PATTERN = "SSNNNSSNSNNSSNSNNSNSSNSN"


class VariantHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, 1, 1), nn.ReLU())
        self.box = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.backbone(x)
        scores = torch.sigmoid(x.mean(1).flatten() * 10)
        keep = torch.nonzero(scores > 0.5).squeeze(1)
        if keep.numel() == 0:  # nothing detected: another path from here on
            return {"boxes": torch.zeros(0, 4), "scores": scores.new_zeros(0)}
        boxes = self.box(f).flatten(2)[0].t()[keep]
        return {"boxes": boxes, "scores": scores[keep]}


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + i)
    x = -torch.rand(1, 3, 16, 16, generator=g) - 0.1
    if PATTERN[i % len(PATTERN)] == "S":
        for k in range(1 + i % 4):  # a few confident pixels, their number following the frame
            x[0, :, 3 * k, 2 + k] = 1.0
    return x


if __name__ == "__main__":
    main(VariantHead, make_input, mode="no_grad", runs=len(PATTERN))
