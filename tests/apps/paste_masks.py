"""Per-detection mask pasting, as torchvision's ``paste_masks_in_image`` runs it (Mask R-CNN's
post-processing): for each box (``for mask, box in zip(masks, boxes)``) the app reads its width
and height, resizes the box's mask to that size, and copies the part inside the image into a
zero image of its own. ``max(box[0], 0)`` and ``min(box[2] + 1, W)`` read whether the box crosses
the image's edge (``box[0] < 0``: a bool the app reads) and are then a tensor or a plain int, so
the calls that follow differ from box to box: the loop's iterations begin alike (its *body*) and
go on in one of several ways (its *variants*), as the four values the app read decide. Frame
``i`` has ``3 + i % 3`` boxes; box ``k`` crosses the left edge, the top one, both or neither
(``(k + i) % 4``), never the right or bottom one; their sizes follow the input data.

``--new-variant K``: from frame K on, each frame's last box crosses the right edge (and no
other), a variant no frame before had: its iteration goes on with calls the sequence does not
have. ``--new-box J``: box J does instead of the last one (``J,L``: boxes J and L).

``--branch K``: from frame K on, every other frame scales the masks once more before the
loop (a call the other frames do not make): two sequences, each with the loop.

``--full-width K``: in frame K box 0 spans the image's whole width without crossing an edge:
its slices ``x0:x1`` of the image and of its mask span their dimensions, which PyTorch's
indexing does not slice (the same guard values as a box inside the image). The boxes that do
not cross the left edge then all begin at column 0, as that box does.

``--degenerate K``: in frame K box 1 has no width (its right edge one column left of its
left one): ``max(int(w), 1)`` passes 1 where the sequence has the width the app read, inside
the loop's body (Mask R-CNN: a box of no width, 2 of its 11 misses in 70 frames).

``--odd K``: in frame K the app pastes its last box one row lower than the box says: a call or
an integer no variant has, in the middle of the loop, after the host ran every iteration's body
(before the app's position) and every variant."""

import sys

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own idiom
from appkit import main
from torch import nn

SIZE = 12  # the image's height and width
NEW = int(sys.argv[sys.argv.index("--new-variant") + 1]) if "--new-variant" in sys.argv else -1
ODD = int(sys.argv[sys.argv.index("--odd") + 1]) if "--odd" in sys.argv else -1
BRANCH = int(sys.argv[sys.argv.index("--branch") + 1]) if "--branch" in sys.argv else -1
NEW_BOXES = [int(j) for j in sys.argv[sys.argv.index("--new-box") + 1].split(",")] \
    if "--new-box" in sys.argv else []
FULL = int(sys.argv[sys.argv.index("--full-width") + 1]) if "--full-width" in sys.argv else -1
FLAT = int(sys.argv[sys.argv.index("--degenerate") + 1]) if "--degenerate" in sys.argv else -1


class PasteMasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU())
        self.masks = nn.Conv2d(8, 1, 3, 1, 1)
        self.scale = nn.Parameter(torch.ones(()))
        self.frame = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.frame += 1
        keep = torch.nonzero(x[0, 1, :, 0] * self.scale > 0.2).squeeze(1)
        b = x[0, 0, keep, :4] * self.scale * SIZE
        boxes = torch.stack([b[:, 0] - 3, b[:, 1] - 3, b[:, 0] + b[:, 2], b[:, 1] + b[:, 3]],
                            dim=1).round().to(torch.int64)
        masks = torch.sigmoid(self.masks(self.backbone(x)))[:, :, :4, :4].expand(
            len(keep), 1, 4, 4)
        if 0 <= BRANCH <= self.frame and (self.frame - BRANCH) % 2 == 0:
            masks = masks * self.scale
        pasted = []
        for n, (mask, box) in enumerate(zip(masks, boxes, strict=True)):
            w = max(int(box[2] - box[0] + 1), 1)
            h = max(int(box[3] - box[1] + 1), 1)
            m = F.interpolate(mask.expand((1, 1, -1, -1)), size=(h, w), mode="bilinear",
                              align_corners=False)[0][0]
            image = torch.zeros((SIZE, SIZE), dtype=m.dtype, device=m.device)
            x0, x1 = max(box[0], 0), min(box[2] + 1, SIZE)
            y0, y1 = max(box[1], 0), min(box[3] + 1, SIZE)
            if self.frame == ODD and n == len(boxes) - 1:
                y0 = y0 + 1
            image[y0:y1, x0:x1] = m[(y0 - box[1]):(y1 - box[1]), (x0 - box[0]):(x1 - box[0])]
            pasted.append(image)
        return torch.stack(pasted)


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9100 + i)
    x = torch.rand(1, 3, 8, 8, generator=g)
    n = 3 + i % 3
    x[0, 1, :, 0] = 0.0
    x[0, 1, :n, 0] = 0.5
    for k in range(n):
        left, top = (k + i) % 4 & 1, (k + i) % 4 >> 1
        corner = (1.0 if left else 4.0, 1.0 if top else 4.0)  # minus 3: -2 or 1
        if FULL >= 0 and not left:
            corner = (3.0, corner[1])  # x0 = 0: a full-width box differs only in its x1
        size = (2 + 4 * float(x[0, 2, k, 0]), 2 + 4 * float(x[0, 2, k, 1]))  # 2 to 6
        if 0 <= NEW <= i and k in (NEW_BOXES or [n - 1]):
            corner, size = (7.0, 4.0), (6.0, size[1])  # x1 + 1 = 14 > SIZE; top inside
        if i == FLAT and k == 1:
            size = (-4.0, size[1])  # x1 = x0 - 1: int(x1 - x0 + 1) is 0, max() makes it 1
        if i == FULL and k == 0:
            corner, size = (3.0, 4.0), (SIZE - 1 - 3.0, size[1])  # x0 = 0, x1 + 1 = SIZE
        x[0, 0, k, :4] = torch.tensor([*corner, *size]) / SIZE
    return x


if __name__ == "__main__":
    main(PasteMasks, make_input, mode="no_grad", runs=8)
