"""Operators of another library registered with the dispatcher (as torchvision registers
``torchvision::nms``). Imported by the custom_op app, and by the test GPU daemon through
``hostlib/sitecustomize.py`` so that the host has them too."""

import torch


@torch.library.custom_op("rrtotest::scale", mutates_args=())
def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@scale.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("rrtotest::shift", mutates_args=())
def shift(x: torch.Tensor, by: float) -> torch.Tensor:
    return x + by


@shift.register_fake
def _(x: torch.Tensor, by: float) -> torch.Tensor:
    return torch.empty_like(x)


def register_blend(version: int) -> None:
    """``rrtotest::blend`` as two releases of this library declare it: version 2 added
    ``bias``. The test GPU daemon has version 1 (``hostlib``), the skewed_op app version 2:
    one operator name, two schemas, as after a library or torch upgrade on one end only."""
    if version == 1:
        @torch.library.custom_op("rrtotest::blend", mutates_args=())
        def blend(x: torch.Tensor, w: float) -> torch.Tensor:
            return x * w
    else:
        @torch.library.custom_op("rrtotest::blend", mutates_args=())
        def blend(x: torch.Tensor, w: float, bias: float = 0.0) -> torch.Tensor:
            return x * w + bias

    @blend.register_fake
    def _(x: torch.Tensor, *args: float) -> torch.Tensor:
        return torch.empty_like(x)
