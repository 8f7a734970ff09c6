"""Boxes assigned to feature levels by their size, each level's boxes run through its own head
and written into one buffer (``result[idx] = head(x[idx])``), as torchvision's
``MultiScaleRoIAlign`` does. Where a level got exactly one box, PyTorch's indexed assignment
views the value without its leading 1 first (an ``aten::view`` the other frames lack); the shim
defers that view (``plugins/torch/assignment.py``), so every frame makes the same calls.

``--squeeze``: the app drops a lone box's leading 1 itself (``v.squeeze(0)`` when a level got
one box), a call the shim must send: the calls an inference makes then depend on which levels
got one box. The frames come in an order where no two in a row go the same way, and how many
boxes each level got changes too: the robot must pair inferences that are not neighbours to
find any sequence at all."""

import sys

import torch
from appkit import main
from torch import nn

LEVELS = 3
SQUEEZE = "--squeeze" in sys.argv
# boxes per level, frame by frame (6 in all): the levels with one box decide the way; never
# the same way twice in a row, and no period
COUNTS = [(2, 1, 3), (1, 3, 2), (3, 2, 1), (1, 4, 1), (2, 2, 2), (1, 2, 3), (4, 1, 1),
          (2, 3, 1), (3, 1, 2), (1, 1, 4), (2, 4, 0), (1, 3, 2), (3, 1, 2), (2, 2, 2),
          (1, 5, 0), (3, 2, 1), (2, 1, 3), (1, 4, 1), (2, 2, 2), (3, 2, 1), (1, 2, 3),
          (2, 1, 3), (4, 1, 1), (2, 3, 1)]


class LevelAssign(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        with torch.no_grad():  # the first feature is the box's size (what picks its level)
            self.embed.weight[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
            self.embed.bias[0] = 0.0
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(LEVELS))

    def forward(self, boxes: torch.Tensor) -> torch.Tensor:
        x = self.embed(boxes)
        levels = (x[:, 0] * LEVELS).floor().clamp(0, LEVELS - 1).long()
        result = torch.zeros(x.shape[0], 8)
        for level, head in enumerate(self.heads):
            idx = torch.where(levels == level)[0]
            pooled = head(x[idx])
            if SQUEEZE and pooled.shape[0] == 1:
                pooled = pooled.squeeze(0)
            result[idx] = pooled
        return result


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9000 + i)
    counts = COUNTS[i % len(COUNTS)]
    level = torch.tensor([lv for lv, n in enumerate(counts) for _ in range(n)])
    boxes = torch.rand(len(level), 4, generator=g)
    boxes[:, 0] = (level + 0.2 + 0.6 * boxes[:, 0]) / LEVELS  # the size that picks the level
    return boxes[torch.randperm(len(level), generator=g)]


if __name__ == "__main__":
    main(LevelAssign, make_input, mode="no_grad", runs=len(COUNTS))
