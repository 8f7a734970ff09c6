"""A model calling an operator whose schema differs between the app and the GPU host:
``rrtotest::blend`` of version 2 of its library here, of version 1 on the test host
(``rrtotest_ops.register_blend``). The host must refuse it rather than run its own meaning;
it then runs here, the rest of the model on the host."""

import rrtotest_ops
import torch
from appkit import inputs, main
from torch import nn

rrtotest_ops.register_blend(version=2)


class Blended(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.ops.rrtotest.blend(self.fc(x), 0.5, 0.25))


if __name__ == "__main__":
    main(Blended, inputs(2, 16), mode="no_grad")
