"""A detector whose app reads only how many detections each frame has: the count comes with the
host's answer for the data-dependent call (``nonzero``), and no value of any output is ever
downloaded. Such inferences end without a download, where sequence searches usually run; the
shim's inference marks start them instead. Frames alternate between many detections and few.
What the app prints is the count (a tensor of its own, made from the Python integer)."""

import torch
from appkit import main
from dynamic_head import DynamicHead


class Detector(DynamicHead):
    """``dynamic_head``'s network with a head that returns only the kept boxes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.backbone(x)
        scores = torch.sigmoid(self.cls(f)).flatten()
        boxes = self.box(f).flatten(2).transpose(1, 2).reshape(-1, 4)
        keep = torch.nonzero(scores > 0.5).squeeze(1)  # data-dependent count
        return boxes[keep] * 2.0


def count(boxes: torch.Tensor) -> torch.Tensor:
    """What the app looks at: the number of boxes (a size, never a value read)."""
    return torch.tensor([boxes.shape[0]])


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7000 + i)
    return torch.randn(1, 3, 32, 32, generator=g) * (1.0 if i % 2 else 0.6)


if __name__ == "__main__":
    main(Detector, make_input, mode="no_grad", runs=8, post=count)
