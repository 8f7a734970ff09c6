"""Local operators by rows (``plugins/torch/rows.py``): a band of an operator's output rows,
computed from bands of its inputs, equals the same rows of the whole result (exactly, or within
float32 rounding where the library sums a band in another order), and the rule that says which
input rows a band reads covers what it reads."""

from __future__ import annotations

import pytest
import torch

from plugins.torch import codec, rows
from rrto.v1 import ops_pb2

aten = torch.ops.aten


def recorded(name: str, args: list) -> ops_pb2.OpCall:
    """The call as the shim records it (tensors by reference)."""
    call = ops_pb2.OpCall(op=name)
    for a in args:
        codec.encode_value(a, call.args.add(), lambda t: ops_pb2.TensorRef(id=1))
    return call


def tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list):
            out += [t for t in a if isinstance(t, torch.Tensor)]
    return out


def check(op, name: str, args: list, exact: bool) -> None:
    whole = op(*args)
    outs = tuple(whole) if isinstance(whole, (tuple, list)) else (whole,)
    how = rows.rule(recorded(name, args), [tuple(t.shape) for t in tensors(args)],
                    [tuple(o.shape) for o in outs])
    assert how is not None, name
    height = outs[0].shape[-2]
    for cut in sorted({1, height // 3, height // 2, height - 1}):
        for lo, hi in ((0, cut), (cut, height)):
            a, b = how.need(lo, hi)
            starts: dict[int, int] = {}
            banded = [band(x, how.height, a, b, starts) for x in args]
            got = rows.run(op, banded, {}, how, starts, lo, hi)
            got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
            for g, w, has in zip(got, outs, how.rows_out, strict=True):
                want = w.narrow(-2, lo, hi - lo) if has else w
                assert g.shape == want.shape, (name, lo, hi)
                if exact or g.dtype == torch.int64:
                    assert torch.equal(g, want), (name, lo, hi)
                else:
                    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-4)


def band(x, height: int, a: int, b: int, starts: dict[int, int]):
    """``x``'s rows ``[a, b)`` alone, as a side that holds only those would (a copy)."""
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] == height:
        y = x.narrow(-2, a, b - a).clone()
        starts[id(y)] = a
        return y
    if isinstance(x, list):
        return [band(i, height, a, b, starts) for i in x]
    return x


X = torch.randn(1, 16, 33, 40, generator=torch.Generator().manual_seed(0))
W3 = torch.randn(8, 16, 3, 3, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 1), (1, 0), (3, 2)])
def test_a_convolution_band_equals_those_rows_of_the_whole(stride, padding):
    check(aten.conv2d.default, "aten::conv2d.default",
          [X, W3, torch.randn(8), [stride, stride], [padding, padding]], exact=False)
    check(aten.convolution.default, "aten::convolution.default",
          [X, W3, None, [stride, stride], [padding, padding], [1, 1], False, [0, 0], 1],
          exact=False)


def test_pools_upsampling_and_elementwise_bands_are_exact():
    """A max (values and indices into the whole input), nearest upsampling, element-wise
    operators with broadcasting, a channel cat, batch norm and an argmax over channels."""
    check(aten.max_pool2d_with_indices.default, "aten::max_pool2d_with_indices.default",
          [X, [3, 3], [2, 2], [1, 1]], exact=True)
    check(aten.max_pool2d_with_indices.default, "aten::max_pool2d_with_indices.default",
          [X, [3, 3], [2, 2], [1, 1], [1, 1], True], exact=True)
    check(aten.max_pool2d.default, "aten::max_pool2d.default", [X, [2, 2]], exact=True)
    check(aten.upsample_nearest2d.default, "aten::upsample_nearest2d.default",
          [X, [66, 80], 2.0, 2.0], exact=True)
    check(aten.upsample_nearest2d.vec, "aten::upsample_nearest2d.vec", [X, None, [2.0, 2.0]],
          exact=True)
    check(aten.relu.default, "aten::relu.default", [X], exact=True)
    check(aten.add.Tensor, "aten::add.Tensor", [X, torch.randn(1, 16, 33, 40)], exact=True)
    check(aten.mul.Tensor, "aten::mul.Tensor", [X, torch.randn(16, 1, 1)], exact=True)
    check(aten.cat.default, "aten::cat.default", [[X, torch.randn(1, 4, 33, 40)], 1], exact=True)
    check(aten.argmax.default, "aten::argmax.default", [X, 1], exact=True)
    check(aten.batch_norm.default, "aten::batch_norm.default",
          [X, torch.randn(16), torch.randn(16), torch.randn(16), torch.rand(16) + 0.5, False,
           0.1, 1e-5, False], exact=True)


def test_operators_that_mix_rows_are_not_local():
    """A reduction or softmax along the rows, an argmax over the last dimension (its result
    has the rows last), bilinear upsampling, batch norm in training: never split by rows."""
    def rule_of(name, args, outs):
        return rows.rule(recorded(name, args), [tuple(t.shape) for t in tensors(args)], outs)

    assert rule_of("aten::argmax.default", [X, -1], [(1, 16, 33)]) is None
    assert rule_of("aten::argmax.default", [X, 2], [(1, 16, 40)]) is None
    assert rule_of("aten::softmax.int", [X, 2], [(1, 16, 33, 40)]) is None
    assert rule_of("aten::upsample_bilinear2d.default", [X, [66, 80], False], [(1, 16, 66, 80)]) \
        is None
    assert rule_of("aten::batch_norm.default", [X, None, None, None, None, True, 0.1, 1e-5,
                                                False], [(1, 16, 33, 40)]) is None
    assert rule_of("aten::linear.default", [X, W3], [(1, 16, 33, 8)]) is None
