"""``sizing.new_bytes`` sizes functional pointwise calls without meta execution: the bytes must
be exactly what meta execution gives, whatever the broadcasting, dtypes, 0-dim operands, Python
numbers and keyword values; anything else still goes through meta execution."""

from __future__ import annotations

import pytest
import torch

from rrto_plugins.torch import pointwise, sizing

aten = torch.ops.aten
f32, i64 = torch.float32, torch.int64


def t(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
    return torch.ones(shape, dtype=dtype)


CALLS = [
    (aten.add.Tensor, [t(5, 4), t(4)], {}),
    (aten.add.Tensor, [t(5, 1), t(1, 7)], {"alpha": 2}),
    (aten.add.Tensor, [t(3, 4, dtype=i64), t(dtype=f32)], {}),  # a 0-dim float: float result
    (aten.add.Tensor, [t(3, 4, dtype=f32), t(dtype=torch.float64)], {}),  # 0-dim: stays f32
    (aten.add.Tensor, [t(3, 4, dtype=f32), t(1, dtype=torch.float64)], {}),  # 1-dim: f64
    (aten.mul.Tensor, [t(6, dtype=torch.uint8), t(6, dtype=torch.int16)], {}),
    (aten.mul.Scalar, [t(6, dtype=i64), 2.5], {}),
    (aten.mul.Scalar, [t(6, dtype=i64), 2], {}),
    (aten.div.Tensor, [t(8, dtype=i64), t(8, dtype=i64)], {}),  # true division: float
    (aten.div.Tensor_mode, [t(8, dtype=i64), t(8, dtype=i64)], {"rounding_mode": "floor"}),
    (aten.eq.Scalar, [t(2, 3), 1.0], {}),  # a comparison: bool
    (aten.ge.Tensor, [t(2, 3), t(3)], {}),
    (aten.clamp.default, [t(9, 4)], {"min": 0.0, "max": 1.0}),
    (aten.clamp.Tensor, [t(9, 4), t(4), t(9, 1)], {}),
    (aten.where.self, [t(3, 1, dtype=torch.bool), t(1, 5), t(3, 5, dtype=torch.float64)], {}),
    (aten.masked_fill.Scalar, [t(4, 4), t(4, 4, dtype=torch.bool), 0.0], {}),
    (aten.relu.default, [t(0, 4)], {}),  # empty: 0 bytes
    (aten.sigmoid.default, [t(2, 3, dtype=i64)], {}),  # int in, float out
    (aten.clone.default, [t(3, 5).t()], {"memory_format": torch.contiguous_format}),
    (aten.lerp.Scalar, [t(4, dtype=torch.float16), t(4, dtype=torch.float16), 0.5], {}),
    (aten.abs.default, [t(3, dtype=torch.complex64)], {}),  # complex in, real out
]


@pytest.mark.parametrize("op, args, kwargs", CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)])
def test_pointwise_calls_are_sized_exactly_as_meta_execution_sizes_them(op, args, kwargs):
    fast = sizing._pointwise_bytes(op, args, kwargs)
    assert fast is not None, "expected the pointwise fast path"
    assert fast == sizing._meta_bytes(op, args, kwargs)
    assert fast == op(*args, **kwargs).untyped_storage().nbytes()  # and what the call makes


@pytest.mark.parametrize("op, args, kwargs", [
    (aten.add_.Tensor, [t(3), t(3)], {}),  # writes its argument
    (aten.cat.default, [[t(3), t(3)]], {}),  # not pointwise, a list argument
    (aten.bernoulli.p, [t(3), 0.5], {}),  # seeded randomness
    (aten.add.Tensor, [t(3), t(4)], {}),  # shapes that do not broadcast: meta execution says so
    (aten.clamp.default, [t(3)], {}),  # neither min nor max: meta execution fails it
])
def test_other_calls_go_through_meta_execution(op, args, kwargs):
    assert sizing._pointwise_bytes(op, args, kwargs) is None


def test_a_pointwise_call_whose_sizes_change_is_sized_per_call_without_meta_execution(monkeypatch):
    """A detector's box count changes every frame: each count is a new signature, sized by a
    product of sizes once the dtype's item size is known."""
    sizing._cache.clear()
    monkeypatch.setattr(sizing, "_DTYPES", pointwise.Dtypes())
    assert sizing.new_bytes(aten.mul.Tensor, [t(3, 4), t(4)], {}) == 3 * 4 * 4
    calls = []
    monkeypatch.setattr(sizing, "_meta_bytes", lambda *a: calls.append(a) or 0)
    for n in (5, 17, 0, 100):
        assert sizing.new_bytes(aten.mul.Tensor, [t(n, 4), t(4)], {}) == n * 4 * 4
    assert calls == []


@pytest.mark.parametrize("op, args", [
    (aten.slice.Tensor, [t(6, 4), 0, 1, 5]),
    (aten.select.int, [t(6, 4), 1, 2]),
    (aten.view.default, [t(6, 4), [24]]),
    (aten.permute.default, [t(2, 3, 4), [2, 0, 1]]),
    (aten.split_with_sizes.default, [t(6, 4), [2, 4]]),
    (aten.unsqueeze.default, [t(6), 0]),
    (aten.expand.default, [t(1, 4), [5, 4]]),
])
def test_views_allocate_nothing_as_meta_execution_says(op, args):
    assert sizing._is_view(op) and sizing._meta_bytes(op, args, {}) == 0


@pytest.mark.parametrize("op", [aten.reshape.default, aten.contiguous.default, aten.to.dtype,
                                aten.flatten.using_ints, aten.add_.Tensor, aten.clone.default])
def test_operators_that_may_copy_are_not_views(op):
    """``reshape`` says its result aliases its input but copies when it cannot view: sized by
    meta execution like any other operator."""
    assert not sizing._is_view(op)


@pytest.mark.parametrize("op, args", [
    (aten.relu_.default, [t(6, 4)]),
    (aten.add_.Tensor, [t(6, 4), t(4)]),
    (aten.index_put_.default, [t(23, dtype=torch.bool), [torch.tensor([1, 5])],
                               torch.tensor(True)]),
    (aten.masked_fill_.Scalar, [t(4, 4), t(4, 4, dtype=torch.bool), 0.0]),
    (aten.copy_.default, [t(3, 5), t(5)]),
    (aten.fill_.Scalar, [t(7), 2.0]),
])
def test_in_place_calls_allocate_nothing_as_meta_execution_says(op, args):
    """An operator computing into ``self`` and returning it is sized without meta execution
    (a detector's per-class loop writes its keep-mask with index tensors of a new length each
    time); the bytes are meta execution's."""
    assert sizing._in_place(op) and sizing._meta_bytes(op, args, {}) == 0
    assert sizing.measure(op, args, {}) == 0


@pytest.mark.parametrize("op", [aten.resize_.default, aten.resize_as_.default,
                                aten.set_.source_Tensor, aten._resize_output_.default,
                                aten.squeeze_.default, aten.add.out, aten.relu.default,
                                aten._native_batch_norm_legit.default])
def test_operators_that_may_grow_a_storage_are_not_sized_as_in_place(op):
    """Those that change metadata may grow the storage (``resize_``: meta execution sees it),
    ``out=`` variants resize their output; batch norm writes statistics it does not return."""
    assert not sizing._in_place(op)
    if op is aten.resize_.default:  # what the rule must not hide
        assert sizing._meta_bytes(op, [t(2), [1000]], {}) == 1000 * 4 - 2 * 4


def _index_on_meta(x: torch.Tensor, indices: list) -> int:
    """What the meta kernel allocates for ``x[indices]``, each mask as int64 indices of its
    length (the most it can select)."""
    expanded: list = []
    for ix in indices:
        if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8):
            expanded += [torch.empty(ix.numel(), dtype=torch.long, device="meta")] * ix.dim()
        else:
            expanded.append(ix if ix is None else ix.to("meta"))
    out = aten.index.Tensor(x.to("meta"), expanded)
    return out.numel() * out.element_size()


def b(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bool)


def ix(*values: object) -> torch.Tensor:
    return torch.tensor(values)


@pytest.mark.parametrize("x, indices", [
    (t(5, 4), [b(5)]),
    (t(5, 4, 3), [b(5, 4)]),
    (t(5, 4, 3), [None, b(4, 3)]),
    (t(5, 4), [torch.zeros(5, dtype=torch.uint8)]),
    (t(5, 4), [ix(1, 2, 3)]),
    (t(5, 4, 3), [None, torch.tensor([[1, 2], [0, 1]])]),
    (t(5, 4, 3), [ix(1, 2), None, ix(0, 1)]),  # separated: the broadcast shape goes first
    (t(5, 4, 3), [ix(1, 2), torch.tensor([[0], [1]])]),  # broadcast to 2 x 2
    (t(5, 4, dtype=torch.float64), [torch.zeros(0, dtype=torch.long)]),
    (t(5, 4), [torch.tensor(2)]),
])
def test_advanced_indexing_is_sized_from_the_sizes_as_the_meta_kernel_sizes_it(x, indices):
    """``x[mask]`` and ``x[i, j]`` with indices of a new length each frame (a detector's
    boxes) are sized without meta execution, to the byte."""
    assert sizing._index(aten.index.Tensor, [x, indices], {}) == _index_on_meta(x, indices)



@pytest.mark.parametrize("x, indices", [
    (t(5, 4), [b(4)]),  # a mask of another shape: the operator raises IndexError
    (t(5, 4), [ix(1), ix(1), ix(1)]),  # too many indices
    (t(5, 4), [ix(1, 2), ix(1, 2, 3)]),  # indices that do not broadcast
    (t(5, 4), [torch.tensor([1.0])]),  # float indices
])
def test_indexing_the_operator_refuses_is_refused_before_it_runs(x, indices):
    with pytest.raises(sizing.MetaFailed):
        sizing._index(aten.index.Tensor, [x, indices], {})
    with pytest.raises((IndexError, RuntimeError)):
        aten.index.Tensor(x, indices)


def test_a_call_that_cannot_be_sized_keeps_no_frames_alive_however_often_it_is_made():
    """The cached failure is raised anew each time: raising the cached exception itself chained
    every raise's traceback onto it, with each failed call's tensors (the native-runs fuzz
    target grew by 4 MB an input)."""
    op = torch.ops.aten.mm.default
    args = [torch.ones(2, 3), torch.ones(4, 5)]
    for _ in range(3):
        with pytest.raises(sizing.MetaFailed) as caught:
            sizing.new_bytes(op, args, {})
        del caught
    (cached,) = [v for k, v in sizing._cache.items() if k[0] is op and isinstance(v, Exception)
                 and k[1] == sizing.signature(args)]
    assert cached.__traceback__ is None
