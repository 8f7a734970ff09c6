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
