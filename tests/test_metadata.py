"""The app works out a call's result metadata without the host (``metadata.MetaCache``). A
functional pointwise call whose tensor arguments share one shape and C-contiguous strides (0-dim
ones aside) gets
its template without meta execution: it must equal what meta execution, and the operator
itself, give (shape, stride, offset, dtype), for every kind of argument."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch

from rrto_plugins.torch import indexing, metadata, pointwise
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


def test_a_0_dim_operand_keeps_the_fast_path_as_the_kernel_and_meta_execution_lay_it_out():
    """A 0-dim tensor beside operands of one C-contiguous shape (``labels == class_id``):
    the template is that shape, C-contiguous, in the promoted dtype - as both the CPU kernel
    and meta execution make it (600 random calls, a fixed seed: 0-dim operands first or
    last, integer, float and bool dtypes). A shape with a size 0 or 1 is left to meta
    execution: the kernel lays those out its own way then."""
    rng = random.Random(13)
    ops = [(aten.eq.Tensor, 2), (aten.gt.Tensor, 2), (aten.add.Tensor, 2), (aten.mul.Tensor, 2),
           (aten.sub.Tensor, 2), (aten.div.Tensor, 2), (aten.minimum.default, 2),
           (aten.where.self, 3), (aten.clamp.Tensor, 3)]
    dtypes = [f32, i64, torch.int32, torch.float64, torch.bool]
    for _ in range(600):
        func, n = rng.choice(ops)
        shape = [rng.choice([0, 1, 2, 3, 5, 7]) for _ in range(rng.randint(1, 4))]
        zero = rng.sample(range(n), rng.randint(1, n - 1))  # at least one operand keeps shape
        args = []
        for k in range(n):
            dtype = torch.bool if func is aten.where.self and k == 0 else rng.choice(dtypes)
            if dtype is torch.bool and func in (aten.sub.Tensor, aten.clamp.Tensor):
                dtype = f32  # (subtracting booleans is refused by the kernel itself)
            args.append(torch.ones([] if k in zero else shape, dtype=dtype))
        fast = MetaCache(Counter())._pointwise(func, tuple(args), {})
        if min(shape) < 2:
            assert fast is None
            continue
        assert fast is not None, (func, [tuple(a.shape) for a in args])
        _, (o,) = fast
        _, (m,) = _meta_only(func, args, {})
        real = func(*args)
        assert (o.shape, o.stride, o.offset, o.dtype) == (
            tuple(real.shape), real.stride(), real.storage_offset(), real.dtype), (func, args)
        assert (o.shape, o.stride, o.offset, o.dtype) == (m.shape, m.stride, m.offset, m.dtype)


def _pointwise_operators() -> list[tuple[Any, list[str]]]:
    """Every aten pointwise overload of this torch that takes two tensors or more, with its
    positional arguments as "T" (tensor) or "S" (number); those with other required
    arguments are left out."""
    found = []
    for name in dir(aten):
        packet = getattr(aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload, None)
            if op is None or not pointwise.is_pointwise(op):
                continue
            kinds, simple = [], True
            for a in op._schema.arguments:
                kind = {"Tensor": "T", "Scalar": "S"}.get(str(a.type))
                if kind is not None and not a.kwarg_only:
                    kinds.append(kind)
                elif not a.has_default_value():
                    simple = False
            if simple and kinds.count("T") >= 2:
                found.append((op, kinds))
    return found


def test_every_pointwise_operator_with_a_0_dim_operand_is_described_as_the_kernel_makes_it():
    """The 0-dim rule holds for every aten pointwise operator this torch has, not only the
    comparisons a detector makes: random shapes (sizes 2 and up), 0-dim operands in random
    places, float and integer dtypes; where the fast path answers, its shape, strides and
    dtype are the CPU kernel's (66 operators on torch 2.13.0 and 2.14.1)."""
    rng, checked = random.Random(3), set()
    for op, kinds in _pointwise_operators():
        tensors = [i for i, k in enumerate(kinds) if k == "T"]
        for _ in range(6):
            shape = [rng.choice([2, 3, 5]) for _ in range(rng.randint(1, 3))]
            zero = set(rng.sample(tensors, rng.randint(1, len(tensors) - 1)))
            dtype = rng.choice([f32, torch.float64, i64])
            args = [(torch.rand([] if i in zero else shape) + 1).to(dtype) if k == "T" else 2
                    for i, k in enumerate(kinds)]
            try:
                real = op(*args)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                continue  # (the kernel refuses these dtypes: the host would say so)
            fast = MetaCache(Counter())._pointwise(op, tuple(args), {})
            if fast is None or not isinstance(real, torch.Tensor):
                continue
            checked.add(op)
            _, (o,) = fast
            assert (o.shape, o.stride, o.dtype) == (
                tuple(real.shape), real.stride(), real.dtype), (op, [a.shape for a in args
                                                                     if isinstance(a, torch.Tensor)])
    assert len(checked) > 40


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


def _random_index_call(rng: random.Random) -> tuple[torch.Tensor, list[Any]]:
    """A tensor (sometimes transposed) and integer index tensors (sometimes ``None``, 0-dim,
    empty or transposed) of random sizes: advanced indexing's cases."""
    shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
    x = torch.randn(shape)
    if rng.random() < 0.2 and x.dim() > 1:
        x = x.transpose(0, x.dim() - 1)
    indices: list[Any] = []
    for d in range(rng.randint(1, x.dim())):
        if rng.random() < 0.3:
            indices.append(None)
            continue
        sizes = [rng.randint(0, 3) for _ in range(rng.randint(0, 2))]
        i = torch.randint(0, x.shape[d], sizes, dtype=rng.choice([torch.int64, torch.int32]))
        indices.append(i.t() if rng.random() < 0.1 and i.dim() == 2 else i)
    return x, indices


def test_an_integer_index_is_described_as_the_kernel_and_meta_execution_make_it():
    """``indexing.indexed``: where it describes ``x[idx]`` at all, the shape, strides and dtype
    are those of both the CPU kernel and meta execution (4 000 random calls, a fixed seed,
    sizes of 1 among them); an empty result it leaves to meta execution."""
    rng, described, ones = random.Random(7), 0, 0
    for _ in range(4000):
        x, indices = _random_index_call(rng)
        got = indexing.indexed(aten.index.Tensor, (x, indices), {})
        if got is None:
            continue
        assert all(got[0]), "an empty result is described"
        described += 1
        ones += 1 in got[0]
        ran = aten.index.Tensor(x, indices)
        meta = aten.index.Tensor(metadata._meta_like(x), [
            None if i is None else metadata._meta_like(i) for i in indices])
        assert got == (tuple(ran.shape), ran.stride(), ran.dtype)
        assert got[:2] == (tuple(meta.shape), meta.stride())
    assert described > 200 and ones > 50


def test_a_detectors_index_of_a_new_count_needs_no_meta_execution(monkeypatch):
    cache = MetaCache(Counter())
    monkeypatch.setattr(metadata, "_to_meta", lambda x: pytest.fail("meta execution ran"))
    boxes = t(1000, 4)
    for n in (7, 1, 31, 250):  # (a class with one box: a (1, 4) result)
        keep = torch.arange(n)
        (_, (o,)) = cache.output_template(aten.index.Tensor, (boxes, [keep]), {})
        assert (o.shape, o.stride, o.dtype) == ((n, 4), (4, 1), f32)
    mask = torch.ones(1000, dtype=torch.bool)  # a mask's count is the data's: not described
    assert indexing.indexed(aten.index.Tensor, (boxes, [mask]), {}) is None
