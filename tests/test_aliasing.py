"""What a call writes and what its outputs share storage with, from real operator schemas
(``rrto_plugins.torch.aliasing``): the host and the shim both derive when a replayed output is
final from these."""

from __future__ import annotations

import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import aliasing


def _call(op: str, *values: ops_pb2.Value, outs: int = 1) -> ops_pb2.OpCall:
    return ops_pb2.OpCall(op=op, args=list(values), out_ids=list(range(100, 100 + outs)))


def _t(i: int) -> ops_pb2.Value:
    return ops_pb2.Value(tensor=ops_pb2.TensorRef(id=i))


def test_views_share_their_argument_and_new_tensors_do_not():
    aten = torch.ops.aten
    assert aliasing.viewed_ids(aten.select.int, _call("aten::select.int", _t(7), ops_pb2.Value(i=0),
                                                      ops_pb2.Value(i=1))) == [7]
    assert aliasing.viewed_ids(aten.add.Tensor, _call("aten::add.Tensor", _t(7), _t(8))) == [0]
    # an in-place op returns its self; a split returns views of it, every one
    assert aliasing.viewed_ids(aten.copy_.default, _call("aten::copy_.default", _t(7),
                                                         _t(8))) == [7]
    assert aliasing.viewed_ids(aten.split.Tensor, _call("aten::split.Tensor", _t(7),
                                                        ops_pb2.Value(i=2), outs=3)) == [7, 7, 7]


def test_writes_are_the_schemas_and_a_training_batch_norms_statistics():
    aten = torch.ops.aten
    assert aliasing.written_ids(aten.copy_.default, _call("aten::copy_.default", _t(7),
                                                          _t(8))) == [7]
    assert aliasing.written_ids(aten.select.int, _call("aten::select.int", _t(7),
                                                       ops_pb2.Value(i=0),
                                                       ops_pb2.Value(i=1))) == []
    bn = _call("aten::batch_norm.default", _t(1), _t(2), _t(3), _t(4), _t(5),
               ops_pb2.Value(b=True), ops_pb2.Value(f=0.1), ops_pb2.Value(f=1e-5),
               ops_pb2.Value(b=False))
    assert aliasing.written_ids(aten.batch_norm.default, bn) == [4, 5]
