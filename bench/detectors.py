"""Real detection and pose models for the benchmark, where their libraries are installed.

torchvision's detectors (Faster R-CNN, RetinaNet, FCOS, SSDlite, Keypoint R-CNN, Mask R-CNN) and Ultralytics'
YOLOv8n detect and pose models, built from their own code with seeded random weights (no
download), at 128x128 as in the compatibility corpus. Each is wrapped so that one call takes the
benchmark's input tensor and returns a tuple of tensors, *including the model's post-processing*:
torchvision's transform, box decoding, score threshold and NMS run inside its ``forward`` in
eval mode; for YOLO the wrapper runs the network and then Ultralytics' ``non_max_suppression``.
The NTO server (``bench.nto``) runs the same wrapper, so it pays for the same post-processing:
``rrto/nto`` compares transparency with a hand-written split that ships the image up and the
detections down.

Score thresholds are lowered so that random weights still detect something (a detector that
keeps nothing would not exercise the data-dependent shapes). These models need torch 2.14.1 with
torchvision 0.29.1 and ultralytics: ``make compat-venv``, then ``make bench-detection``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SIZE = 128
# torchvision builder, its keyword arguments (score thresholds low enough for random weights)
TORCHVISION = {
    "tv-fasterrcnn": ("fasterrcnn_mobilenet_v3_large_fpn", {"box_score_thresh": 0.001}),
    "tv-retinanet": ("retinanet_resnet50_fpn", {"score_thresh": 0.001}),
    "tv-fcos": ("fcos_resnet50_fpn", {"score_thresh": 0.001}),
    "tv-ssdlite": ("ssdlite320_mobilenet_v3_large", {"score_thresh": 0.001, "size": None}),
    "tv-keypointrcnn": ("keypointrcnn_resnet50_fpn", {"box_score_thresh": 0.001}),
    # every detection's mask pasted into the image by a per-box Python loop (variants)
    "tv-maskrcnn": ("maskrcnn_resnet50_fpn", {"box_score_thresh": 0.001}),
    # at most 3 people: with random weights the count differs every frame otherwise
    "tv-keypointrcnn-top3": ("keypointrcnn_resnet50_fpn", {"box_score_thresh": 0.001,
                                                           "box_detections_per_img": 3}),
}
ULTRALYTICS = {"yolov8n": "yolov8n.yaml", "yolov8n-pose": "yolov8n-pose.yaml"}
# Per detection, what torchvision returns, in a fixed order (those a model has).
KEYS = ("boxes", "scores", "labels", "keypoints", "keypoints_scores", "masks")


class TorchvisionDetector(nn.Module):
    """``model([image])`` (a list of images, as torchvision takes them) as a tuple."""

    def __init__(self, builder: str, kwargs: dict[str, Any]):
        super().__init__()
        from torchvision.models import detection
        # SSD resizes to its own fixed size (320x320); the others to SIZE
        sizes = {} if "size" in kwargs else {"min_size": SIZE, "max_size": SIZE}
        kwargs = {k: v for k, v in kwargs.items() if k != "size"}
        self.model = getattr(detection, builder)(weights=None, weights_backbone=None,
                                                 **sizes, **kwargs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        (found,) = self.model(list(x))
        return tuple(found[k] for k in KEYS if k in found)


class YoloDetector(nn.Module):
    """An Ultralytics network, then its NMS (what ``predict()`` does after letterboxing)."""

    def __init__(self, config: str):
        super().__init__()
        from ultralytics.nn.tasks import DetectionModel, PoseModel
        cls = PoseModel if "pose" in config else DetectionModel
        self.net = cls(config, verbose=False)
        self.classes = 1 if "pose" in config else 80

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from ultralytics.utils.nms import non_max_suppression
        preds = self.net(x)
        (kept,) = non_max_suppression(preds, conf_thres=0.01, iou_thres=0.7, nc=self.classes)
        return (kept,)


def available() -> dict[str, Callable[[], nn.Module]]:
    """Builders of the models whose libraries import here (none beside torch 2.13)."""
    out: dict[str, Callable[[], nn.Module]] = {}
    if importlib.util.find_spec("torchvision") is not None:
        for name, (builder, kwargs) in TORCHVISION.items():
            out[name] = lambda b=builder, k=kwargs: TorchvisionDetector(b, k)
    if importlib.util.find_spec("ultralytics") is not None:
        for name, config in ULTRALYTICS.items():
            out[name] = lambda c=config: YoloDetector(c)
    return out
