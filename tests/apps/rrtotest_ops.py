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


@torch.library.custom_op("rrtotest::keep_above", mutates_args=())
def keep_above(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The values of the 1-D ``x`` above ``threshold``, in order: how many depends on the data,
    as for ``torchvision::nms``."""
    return x[x > threshold].clone()


@keep_above.register_fake
def _(x: torch.Tensor, threshold: float) -> torch.Tensor:
    return x.new_empty(torch.library.get_ctx().new_dynamic_size())


@torch.library.custom_op("rrtotest::mul_add", mutates_args=())
def mul_add(x: torch.Tensor, w: float, b: float) -> torch.Tensor:
    return x * w + b


@mul_add.register_fake
def _(x: torch.Tensor, w: float, b: float) -> torch.Tensor:
    return torch.empty_like(x)


def _register_reviewed() -> None:
    """Give the host's reviewed library table (``rrto_plugins.torch.libops``) this library, the
    way a plugin loaded into the daemon would: ``rrtotest`` is on the host whenever this module
    is (the test daemon imports it); ``rrtoabsent`` names a module no host has, so its operator
    is refused as on a host without the library."""
    try:
        from rrto_plugins.torch import libops
    except ImportError:  # a plain local run without rrto installed
        return
    libops.register(libops.Library("rrtotest", "rrtotest_ops", (
        libops.LibraryOp("rrtotest::keep_above.default",
                         "test library: a data-dependent output size, as nms",
                         shape=libops.ShapeRule((libops.Output("x", (libops.DataDim("x", 0),)),))),
        libops.LibraryOp("rrtotest::mul_add.default", "test library: a fixed-shape operator"),
    )))
    libops.register(libops.Library("rrtoabsent", "rrtotest_absent_library", (
        libops.LibraryOp("rrtoabsent::twice.default", "test library that no host has"),
    )))


_register_reviewed()
