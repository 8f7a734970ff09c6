"""Wire encoding of tensors and operator arguments (both ends use plugins/torch/codec.py)."""

from __future__ import annotations

import pytest
import torch

from rrto.v1 import ops_pb2
from rrto_plugins.torch import codec
from rrto_plugins.torch.allowlist import Allowlist, builtin_names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.bool, torch.uint8, torch.complex64])
def test_tensor_roundtrip_is_bitwise(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    msg = ops_pb2.TensorData.FromString(codec.tensor_data(t).SerializeToString())
    back = codec.from_tensor_data(msg)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8) if dtype != torch.bool else back,
                       t.view(torch.uint8) if dtype != torch.bool else t)


def test_non_contiguous_and_empty_tensors():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(codec.from_tensor_data(codec.tensor_data(t)), t)
    e = torch.empty(0, 3)
    assert codec.from_tensor_data(codec.tensor_data(e)).shape == (0, 3)
    assert torch.equal(codec.from_tensor_data(codec.tensor_data(torch.tensor(7))), torch.tensor(7))


@pytest.mark.parametrize("t", [
    torch.randn(1, 32).t(),  # strides (1, 32): only a size-1 dimension differs
    torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    torch.arange(12.0).reshape(3, 4).t(),
], ids=["transposed-row", "channels_last", "transposed"])
def test_an_upload_keeps_the_apps_dense_layout(t):
    """The host rebuilds an uploaded tensor in the app's layout: CPU kernels pick their
    summation order by strides (hf-clip's logits differed in the last bit when a ``[32, 1]``
    operand with strides ``(1, 32)`` arrived as ``(1, 1)``). The bytes stay C-contiguous."""
    msg = ops_pb2.TensorData.FromString(codec.tensor_data(t, keep_layout=True).SerializeToString())
    assert msg.data == t.contiguous().numpy().tobytes()
    back = codec.from_tensor_data(msg)
    assert back.stride() == t.stride() and torch.equal(back, t)
    assert codec.from_tensor_data(codec.tensor_data(t)).is_contiguous()  # persistent: canonical


@pytest.mark.parametrize("shape,stride", [
    ((4, 3), (1, 1)),  # overlapping
    ((4, 3), (0, 1)),  # a broadcast: 12 elements from 3
    ((4, 3), (6, 1)),  # gaps: a storage larger than the data
    ((4, 3), (3,)),  # a stride per dimension
    ((4, 3), (-3, 1)),
])
def test_wire_strides_that_are_not_a_dense_layout_are_refused(shape, stride):
    msg = codec.tensor_data(torch.zeros(shape))
    msg.meta.stride[:] = stride
    with pytest.raises(codec.CodecError, match="strides"):
        codec.from_tensor_data(msg)


def test_size_mismatch_is_rejected():
    msg = codec.tensor_data(torch.zeros(4))
    msg.data = msg.data[:-1]
    with pytest.raises(codec.CodecError, match="expected 16"):
        codec.from_tensor_data(msg)
    msg.meta.dtype = "pyobject"
    with pytest.raises(codec.CodecError, match="unknown dtype"):
        codec.from_tensor_data(msg)


def test_values_roundtrip():
    value = [None, True, 3, -2.5, "mean", (1, 2), [], torch.float16, torch.device("cpu"),
             torch.channels_last, torch.strided, 1 + 2j]
    out = ops_pb2.Value()
    codec.encode_value(value, out, lambda t: ops_pb2.TensorRef(id=1))
    wire = ops_pb2.Value.FromString(out.SerializeToString())
    back = codec.decode_value(wire, lambda r: None, torch.device)
    assert back == value
    assert isinstance(back[5], tuple) and isinstance(back[6], list)


def test_tensor_args_go_through_callback_and_unknown_types_refuse():
    out = ops_pb2.Value()
    codec.encode_value([torch.zeros(1), None], out, lambda t: ops_pb2.TensorRef(id=42))
    assert out.list.items[0].tensor.id == 42
    with pytest.raises(codec.CodecError, match="Generator"):
        codec.encode_value(torch.Generator(), ops_pb2.Value(), lambda t: None)


def test_allowlist_refuses_files_storages_and_foreign_namespaces():
    allow = Allowlist()
    assert allow.allows("aten::convolution.default") and allow.allows("aten::add.Tensor")
    for name in ("aten::from_file.default", "aten::set_.source_Storage", "aten::_print.default",
                 "aten::record_stream.default", "torchvision::nms.default", "os::system",
                 "aten::nope.default", "aten::add.Tensor; rm -rf /", "builtins::eval"):
        assert not allow.allows(name), name
    assert Allowlist(deny=("aten::relu",)).allows("aten::relu.default") is False
    names = builtin_names()
    assert "aten::addmm.default" in names and not any("from_file" in n for n in names)


@pytest.mark.parametrize("t", [
    torch.randn(1, 3, 64, 64),  # 48 KiB: beyond one join, sent from the tensor's memory
    torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous: uploaded C-contiguous
    torch.empty(0, 3), torch.tensor(7), torch.randn(2, 300).requires_grad_(),
    (torch.randn(4) * 10).to(torch.bfloat16),
], ids=["large", "transposed", "empty", "scalar", "requires_grad", "bfloat16"])
@pytest.mark.parametrize("slot", [0, 1, 300])
def test_encoded_replay_upload_is_the_message_it_stands_for(t, slot):
    """An input frame encoded without copying the tensor parses as exactly the SessionUp the
    message-building path makes, and channels that take messages can serialize it."""
    want = ops_pb2.SessionUp(arg=ops_pb2.ReplayArg(
        slot=slot, tensor=ops_pb2.TensorRef(upload=codec.tensor_data(t, keep_layout=True))))
    cache: dict = {}
    for _ in range(2):  # the second time with the metadata from the cache
        frame = codec.replay_upload(slot, t, cache)
        wire = frame.SerializeToString()
        assert frame.size == len(wire) and frame.WhichOneof("msg") == "arg"
        assert ops_pb2.SessionUp.FromString(wire) == want
    assert len(cache) == 1


def _framed(sock):
    """A ``FramedSocket`` around a connected socket (no path to connect to here)."""
    from rrtod.framing import FramedSocket

    framed = FramedSocket.__new__(FramedSocket)
    framed.path, framed.sock, framed._buf = "", sock, bytearray()
    return framed


def test_socket_channel_writes_encoded_frames_in_order():
    import socket
    import threading

    from rrto.v1 import local_pb2
    from rrtod.shim.channel import SocketChannel

    a, b = socket.socketpair()
    channel = SocketChannel.__new__(SocketChannel)  # the hello is not what is tested here
    channel.sock, channel._wlock = _framed(a), threading.Lock()
    t = torch.randn(1, 3, 64, 64)
    start = ops_pb2.SessionUp(start=ops_pb2.ReplayStart(sequence=5, base_id=7, inference=7))
    channel.send([start, codec.replay_upload(2, t, {}), start])
    reader = _framed(b)
    got = [reader.recv(local_pb2.LocalRequest).session for _ in range(3)]
    assert got[0] == start and got[2] == start
    assert got[1].arg.slot == 2
    assert torch.equal(codec.from_tensor_data(got[1].arg.tensor.upload), t)
    a.close()
    b.close()
