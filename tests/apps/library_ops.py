"""A model that calls operators of a reviewed library (``rrtotest_ops``, registered with the
host's library table): ``rrtotest::keep_above`` returns as many values as pass a threshold (a
data-dependent size, like ``torchvision::nms``), ``rrtotest::mul_add`` has a fixed shape; both
run on the host, which has the library. ``rrtoabsent::twice`` belongs to a library the table
lists but no host has: the host refuses it, it runs here with one warning."""

import rrtotest_ops  # noqa: F401  registers rrtotest:: and the reviewed table entries
import torch
from appkit import inputs, main
from torch import nn


@torch.library.custom_op("rrtoabsent::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Filter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        scores = self.fc(x).flatten()
        kept = torch.ops.rrtotest.keep_above(scores, 0.1)  # size known on the host only
        moved = torch.ops.rrtotest.mul_add(kept, 2.0, -1.0)
        doubled = torch.ops.rrtoabsent.twice(moved)
        return kept, moved.softmax(0), doubled + moved, scores[: kept.shape[0]]


if __name__ == "__main__":
    main(Filter, inputs(2, 16), mode="no_grad")
