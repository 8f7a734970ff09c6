"""In-place writes during inference: ReLU(inplace=True), a residual ``+=``, and batch norms in
training mode whose running statistics (persistent tensors) change on every inference. A branch
on the data makes some inferences take another path after the first norm: the replay, run ahead
on the host, must then undo the second norm's update. The running statistics are printed last,
so any update applied wrongly (or twice) shows."""

import torch
from appkit import flat, main
from torch import nn

SIGNS = [1, 1, 1, 1, 1, -1, 1, 1, -1, 1, 1, 1]


class Stateful(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.act = nn.ReLU(inplace=True)
        self.bn2 = nn.BatchNorm1d(16)
        self.alt = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn1(self.stem(x)))
        if x.sum() > 0:
            h += self.bn2(h)
        else:
            h = self.alt(h)
        return self.head(h)


class Train(Stateful):
    def eval(self):  # appkit calls .eval(): keep the norms updating their statistics
        return self.train()


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9000 + i)
    return torch.randn(4, 8, generator=g).abs() * SIGNS[i % len(SIGNS)]


def stats(out: torch.Tensor) -> list[torch.Tensor]:
    return [out, *flat([model.bn1.running_mean, model.bn2.running_var])]


model: Stateful | None = None


def build() -> nn.Module:
    global model
    model = Train()
    return model


if __name__ == "__main__":
    main(build, make_input, mode="no_grad", runs=len(SIGNS), post=stats)
