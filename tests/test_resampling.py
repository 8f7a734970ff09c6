"""Resampling calls to a given size (``upsample_*``) are described without meta execution
(``resampling.resized``): the app's result template (``metadata.MetaCache``) and the host's
quota bytes (``sizing.new_bytes``) must equal what meta execution and the operator itself give
(shape, stride, dtype, bytes), for every input layout the rule takes; other layouts and calls
are left to meta execution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own idiom

from rrto_plugins.torch import metadata, resampling, sizing
from rrto_plugins.torch.metadata import MetaCache

aten = torch.ops.aten


def mask(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.rand(shape).to(dtype)


DESCRIBED = [
    (aten.upsample_bilinear2d.default, [mask(1, 1, 28, 28), [13, 7], False]),
    # a box's mask as Mask R-CNN's paste loop resizes it: ``mask.expand((1, 1, -1, -1))``
    (aten.upsample_bilinear2d.default, [mask(1, 28, 28).expand((1, 1, -1, -1)), [5, 9], False]),
    (aten.upsample_bilinear2d.default, [mask(2, 3, 8, 8, dtype=torch.float64), [16, 16], True]),
    (aten.upsample_nearest2d.default, [mask(1, 4, 6, 6), [12, 3]]),
    (aten.upsample_bicubic2d.default, [mask(1, 2, 5, 5), [10, 10], False]),
    (aten.upsample_linear1d.default, [mask(2, 3, 7), [11], False]),
    (aten.upsample_nearest3d.default, [mask(1, 1, 2, 3, 4), [4, 6, 8]]),
    # ``.vec`` with a size (no scale factors): what ``F.interpolate`` reaches on a proxy
    (aten.upsample_bilinear2d.vec, [mask(1, 1, 30, 30), [137, 61], False, None]),
    (aten.upsample_nearest2d.vec, [mask(1, 16, 4, 4), [8, 8], None]),
]


@pytest.mark.parametrize("op, args", DESCRIBED, ids=[f"{c[0]}-{i}" for i, c in enumerate(DESCRIBED)])
def test_a_resampling_call_is_described_as_meta_execution_and_the_operator_make_it(op, args):
    shape, stride, dtype = resampling.resized(op, args, {})  # type: ignore[misc]
    real = op(*args)
    assert (shape, stride, dtype) == (tuple(real.shape), real.stride(), real.dtype)
    template, (out,) = MetaCache(Counter()).output_template(op, tuple(args), {})
    assert isinstance(template, metadata.Out)
    assert (out.shape, out.stride, out.offset, out.dtype) == (shape, stride, 0, dtype)
    assert sizing.measure(op, args, {}) == sizing._meta_bytes(op, args, {}) \
        == real.untyped_storage().nbytes()


@pytest.mark.parametrize("op, args", [
    # channels-last input: its output's layout is each device kernel's (meta execution knows)
    (aten.upsample_bilinear2d.default,
     [mask(1, 3, 8, 8).to(memory_format=torch.channels_last), [4, 4], False]),
    (aten.upsample_bilinear2d.vec, [mask(1, 1, 8, 8), None, False, [2.0, 2.0]]),  # by scale
    (aten.upsample_bilinear2d.default, [mask(1, 1, 8, 8), [4], False]),  # a size per dimension
    (aten.upsample_nearest2d.default, [mask(1, 1, 8, 8), [0, 4]]),  # an empty output
    (aten.add.Tensor, [mask(2, 2), mask(2, 2)]),
])
def test_other_calls_and_layouts_are_left_to_meta_execution(op, args):
    assert resampling.resized(op, args, {}) is None


def test_interpolate_of_a_new_size_every_call_needs_no_meta_execution(monkeypatch):
    """As the paste loop does, once per detection: each size is a new signature."""
    seen: list[object] = []
    cache = MetaCache(Counter())
    monkeypatch.setattr(metadata, "_to_meta", lambda x: seen.append(x) or x)
    for h, w in [(3, 4), (17, 9), (28, 2)]:
        x = mask(1, 28, 28).expand((1, 1, -1, -1))
        _, (out,) = cache.output_template(aten.upsample_bilinear2d.default,
                                          (x, [h, w], False), {})
        real = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False)
        assert (out.shape, out.stride) == (tuple(real.shape), real.stride())
    assert seen == []
