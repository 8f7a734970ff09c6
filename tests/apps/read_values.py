"""A pose head's per-box loop, as torchvision's keypoint post-processing runs it: for each
detected box the app reads its width and height (``int(w.item())``), resizes the heatmaps to
that size (``interpolate(size=(h, w))``) and decodes the peak with the width it read
(``pos % w``), writing each box's row of a buffer it made before the loop and returns whole
(``scores[i, :] = ...``: a write through a view). The integers the app passes follow values it
read, different every frame; the box count (a ``nonzero``) is three on every frame.

``--fewer K``: frame K has two boxes. The host, running ahead of the app, starts the third
box's iteration and fails on it (its ``select`` is out of range); the app never makes that
call: its loop ends after two. A forced mismatch whose host-side failure must never reach the
app: that inference is forwarded from where it went another way, with outputs equal to local.

``--odd K``: in frame K the app decodes its last box with ``w + 1``, not the width it read: a
mismatch in the last iteration. The host has run the whole inference ahead with ``w`` and
pushed the buffer; that push is stale (the row written after the mismatch differs) and must
never be what the app reads.

``--varying``: frame ``i`` has ``1 + (i + 1) % 4`` boxes (2, 3, 4, 1, 2, ...), so the loop runs
another number of times from one frame to the next, once in every fourth: replayed by unrolling
its one recorded iteration (``SeqLoop``).

``--stop-early K``: in frame K the loop stops after its first box (``break``), though the box
count says more: the host, which unrolled the loop for the count, runs iterations the app never
makes, and the app's ``stack`` of one item is a mismatch where the second iteration was due.

``--refine``: each box's scores also go through a small linear layer (a weight read in every
iteration, as a per-box head on crops reads its own), bound once for every iteration.

``--same-first N``: the first N frames have boxes of the same sizes (at other places, with
other pixels), so the widths and heights the app reads are equal in the inferences the sequence
is found from, and it takes them for constants. A later frame's other size is a mismatch; the
robot rebuilds those aborted inferences with their own values and finds the sequence again,
with the integers following the values read: from then on every frame replays."""

import sys

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own idiom
from appkit import main
from torch import nn

KEYPOINTS = 4


class ReadValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(),
                                      nn.Conv2d(8, KEYPOINTS, 3, 1, 1))
        self.scale = nn.Parameter(torch.ones(()))  # boxes come out of the model (the host)
        self.frame = -1
        self.odd = int(sys.argv[sys.argv.index("--odd") + 1]) if "--odd" in sys.argv else -1
        self.stop = (int(sys.argv[sys.argv.index("--stop-early") + 1])
                     if "--stop-early" in sys.argv else -1)
        self.refine = nn.Linear(KEYPOINTS, KEYPOINTS) if "--refine" in sys.argv else None

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        maps = self.backbone(x)[0]  # (KEYPOINTS, 8, 8)
        rows = x[0, 0, :, :4] * self.scale  # boxes (x0, y0, x1, y1), one per row
        keep = torch.nonzero(x[0, 1, :, 0] * self.scale > 0.5).squeeze(1)
        boxes = rows[keep]
        widths = (boxes[:, 2] - boxes[:, 0]).clamp(min=1).ceil()
        heights = (boxes[:, 3] - boxes[:, 1]).clamp(min=1).ceil()
        self.frame += 1
        points = []
        scores = torch.zeros(len(boxes), KEYPOINTS)
        for i in range(len(boxes)):
            if i == 1 and self.frame == self.stop:
                break
            w = int(widths[i].item())
            h = int(heights[i].item())
            m = F.interpolate(maps[None], size=(h, w), mode="bilinear", align_corners=False)[0]
            pos = m.reshape(KEYPOINTS, -1).argmax(dim=1)
            odd = self.frame == self.odd and i == len(boxes) - 1
            x = pos % (w + 1 if odd else w)
            row = x.float() if self.refine is None else self.refine(x.float())
            scores[i, :] = row + m.amax(dim=(1, 2))
            points.append(torch.stack([x, torch.div(pos, w, rounding_mode="floor")], 1)
                          .float() + boxes[i, :2])
        return {"boxes": boxes, "points": torch.stack(points), "scores": scores}


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9000 + i)
    x = torch.zeros(1, 3, 16, 16)
    fewer = "--fewer" in sys.argv and i == int(sys.argv[sys.argv.index("--fewer") + 1])
    same_first = int(sys.argv[sys.argv.index("--same-first") + 1]) if "--same-first" in sys.argv else 0
    boxes = 1 + (i + 1) % 4 if "--varying" in sys.argv else 2 if fewer else 3
    for k in range(boxes):
        row = 2 + 4 * k
        x0, y0 = torch.randint(0, 6, (2,), generator=g).tolist()
        j = 0 if i < same_first else i
        w, h = 3 + (3 * j + k) % 10, 4 + (5 * j + 2 * k) % 9  # another size every frame
        x[0, 0, row, :4] = torch.tensor([x0, y0, x0 + w - 0.5, y0 + h - 0.25])
        x[0, 1, row, 0] = 0.6 + 0.01 * i  # a score above the threshold
    x[0, 2] = torch.randn(16, 16, generator=g)
    return x


if __name__ == "__main__":
    main(ReadValues, make_input, mode="no_grad", runs=10)
