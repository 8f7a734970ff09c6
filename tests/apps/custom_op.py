"""A model that calls operators of another library registered with ``torch.library``:
``rrtotest::scale`` (the test host allows it) and ``rrtotest::shift`` (the host refuses it:
it runs here, after a download)."""

import rrtotest_ops  # noqa: F401  registers rrtotest::scale and rrtotest::shift
import torch
from appkit import inputs, main
from torch import nn


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.rrtotest.scale(self.fc(x), 0.5)
        return torch.relu(torch.ops.rrtotest.shift(y, 0.25))


if __name__ == "__main__":
    main(Scaled, inputs(2, 16), mode="no_grad")
