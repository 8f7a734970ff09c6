"""A sequence that reaches the app in the middle of an inference: the forward pauses halfway
through its third inference (a sensor read, a slow pre-processing step: anything that is not an
operator), long enough for the robot to find the sequence of the first two and push it. The
app must replay the rest of that very inference (joined under way), with outputs equal to
local; the first call after the pause writes a value made before it in place. ``--diverge``
also makes the third inference take another path a few calls after the
pause: the joined replay then mismatches and the inference is completed by forwarding."""

import sys
import time

import torch
from appkit import inputs, main
from torch import nn

PAUSE_AT, PAUSE_S = 3, 1.5


class TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.second = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                                    nn.Conv2d(8, 4, 3, padding=1), nn.ReLU())
        self.calls = 0
        self.diverge = "--diverge" in sys.argv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.first(x)
        if self.calls == PAUSE_AT:
            time.sleep(PAUSE_S)
        h.add_(0.5)  # in place, on a value made before the pause (a joined one)
        h = self.second[0](h).relu()
        if self.diverge and self.calls == PAUSE_AT:
            h = h * 2  # another path, after the replay joined
        return self.second[3](self.second[2](h)).flatten(1).softmax(-1)


if __name__ == "__main__":
    main(TwoStages, inputs(1, 3, 16, 16), mode="no_grad", runs=6)
