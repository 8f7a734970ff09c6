"""The app works out a call's result metadata without the host (``metadata.MetaCache``). A
functional pointwise call whose tensor arguments share one shape and C-contiguous strides gets
its template without meta execution: it must equal what meta execution, and the operator
itself, give (shape, stride, offset, dtype), for every kind of argument."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rrto_plugins.torch import metadata
from rrto_plugins.torch.metadata import MetaCache

aten = torch.ops.aten
f32, i64 = torch.float32, torch.int64


def t(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype)


FAST = [
    (aten.add.Tensor, [t(5, 4), t(5, 4)], {"alpha": 2}),
    (aten.add.Tensor, [t(3, 4, dtype=i64), t(3, 4, dtype=torch.float64)], {}),
    (aten.add.Tensor, [t(dtype=i64), t(dtype=f32)], {}),  # both 0-dim
    (aten.mul.Scalar, [t(6, dtype=i64), 2.5], {}),
    (aten.mul.Scalar, [t(6, dtype=i64), 2], {}),
    (aten.div.Tensor, [t(8, dtype=i64), t(8, dtype=i64)], {}),
    (aten.div.Tensor_mode, [t(8, dtype=i64), t(8, dtype=i64)], {"rounding_mode": "floor"}),
    (aten.eq.Scalar, [t(2, 3), 1.0], {}),
    (aten.clamp.default, [t(9, 4)], {"min": 0.0, "max": 1.0}),
    (aten.clamp.default, [t(9, 1)], {"min": 0.0}),  # a size-1 dimension
    (aten.where.self, [t(3, 5, dtype=torch.bool), t(3, 5), t(3, 5, dtype=torch.float64)], {}),
    (aten.sigmoid.default, [t(2, 3, dtype=i64)], {}),
    (aten.relu.default, [t(0, 4)], {}),
    (aten.clone.default, [t(2, 3, 4, 5)], {"memory_format": torch.contiguous_format}),
    (aten.exp.default, [t(1, 1, 3)], {}),
    (aten.abs.default, [t(3, dtype=torch.complex64)], {}),
]


def _meta_only(func, args, kwargs):
    cache = MetaCache(Counter())
    cache._pointwise = lambda *a: None  # type: ignore[method-assign]
    return cache.output_template(func, tuple(args), kwargs)


@pytest.mark.parametrize("func, args, kwargs", FAST, ids=[f"{c[0]}-{i}" for i, c in enumerate(FAST)])
def test_pointwise_template_equals_meta_execution_and_the_operator(func, args, kwargs):
    cache = MetaCache(Counter())
    fast = cache._pointwise(func, tuple(args), kwargs)
    assert fast is not None, "expected the pointwise fast path"
    _, (o,) = fast
    _, (m,) = _meta_only(func, args, kwargs)
    real = func(*args, **kwargs)
    for got in (m, real):
        shape = tuple(got.shape)
        stride = got.stride if isinstance(got, metadata.Out) else got.stride()
        offset = got.offset if isinstance(got, metadata.Out) else got.storage_offset()
        assert (o.shape, o.stride, o.offset, o.dtype) == (shape, tuple(stride), offset, got.dtype)


@pytest.mark.parametrize("func, args, kwargs", [
    (aten.add.Tensor, [t(5, 4), t(4)], {}),  # broadcast: meta execution decides the layout
    (aten.add.Tensor, [t(4, 5).t(), t(5, 4)], {}),  # a transposed operand
    (aten.sub.Tensor, [t(6, 4)[:, 0], t(6, 4)[:, 2]], {}),  # strided column slices
    (aten.clone.default, [t(2, 3, 4, 5)], {"memory_format": torch.channels_last}),
    (aten.add_.Tensor, [t(3), t(3)], {}),  # writes its argument
    (aten.cat.default, [[t(3), t(3)]], {}),
    (aten.bernoulli.p, [t(3), 0.5], {}),
])
def test_other_calls_are_left_to_meta_execution(func, args, kwargs):
    assert MetaCache(Counter())._pointwise(func, tuple(args), kwargs) is None


def test_the_fast_path_is_what_output_template_answers_for_a_new_size(monkeypatch):
    """A box count that changes every frame: one dtype worked out, no meta execution after."""
    cache = MetaCache(Counter())
    assert cache.output_template(aten.mul.Tensor, (t(3, 4), t(3, 4)), {})[1][0].shape == (3, 4)
    monkeypatch.setattr(metadata, "_to_meta", lambda x: pytest.fail("meta execution ran"))
    for n in (5, 17, 0):
        (_, (o,)) = cache.output_template(aten.mul.Tensor, (t(n, 4), t(n, 4)), {})
        assert (o.shape, o.stride, o.dtype) == ((n, 4), (4, 1), f32)
