"""An MLP policy: observation -> action mean, in a thread the app starts (no_grad)."""

from appkit import inputs, main
from torch import nn


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(48, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 12))


if __name__ == "__main__":
    main(build, inputs(1, 48), mode="no_grad", runs=4)
