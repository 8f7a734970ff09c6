"""Two models in one process: a detector whose top-scoring features feed a classifier. One
inference runs both; they are replayed as one sequence, or each as its own."""

import torch
from appkit import inputs, main
from torch import nn


class Pipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.detector = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 9, 1))
        self.classifier = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.detector(x).flatten(2)  # B, 9, anchors: score + 8 features
        top = out[:, 0].topk(3, dim=1).indices  # B, 3
        feats = out[:, 1:].gather(2, top.unsqueeze(1).expand(-1, 8, -1)).transpose(1, 2)
        return top, self.classifier(feats).softmax(-1)


if __name__ == "__main__":
    main(Pipeline, inputs(1, 3, 16, 16), mode="no_grad", runs=8)
