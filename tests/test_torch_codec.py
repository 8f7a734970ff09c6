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


@pytest.mark.parametrize("palette", [b"", bytes(256 * 4)], ids=["raw", "palette"])
def test_an_empty_shape_whose_strides_would_overflow_is_refused(palette):
    """[0, 2**63 - 1, 0, 21] holds no element, but torch works out its strides all the same
    and raised a RuntimeError (found by fuzzing, tests/fuzz/regressions/codec)."""
    msg = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float32",
                                                     shape=[0, 2**63 - 1, 0, 21]),
                             palette=palette, palette_block=1)
    with pytest.raises(codec.CodecError, match="overflows"):
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


# -- palette-coded uploads (codec.palette_of, TensorData.palette) -------------------------------
_PIXELS = torch.randint(0, 256, (1, 3, 40, 56), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
_HWC = _PIXELS[0].permute(1, 2, 0).contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _sent(t: torch.Tensor) -> tuple[ops_pb2.TensorData, torch.Tensor]:
    wire = codec.replay_upload(0, t, {}).SerializeToString()
    data = ops_pb2.SessionUp.FromString(wire).arg.tensor.upload
    return data, codec.from_tensor_data(data)


@pytest.mark.parametrize("t,groups", [
    (_PIXELS.float() / 255, 1),  # ToTensor: [0, 1]
    (_PIXELS * torch.tensor(1 / 255), 1),  # a uint8 frame times a float scale
    ((_PIXELS.float() / 255 - _MEAN) / _STD, 3),  # Normalize: per channel (NCHW)
    ((_HWC.float() / 255 - _MEAN.view(3)) / _STD.view(3), 3),  # per channel, HWC
    (_PIXELS.to(torch.float16) / 255, 1),
    (_PIXELS.to(torch.bfloat16) / 255, 1),
    (_PIXELS.double() / 255, 1),
    ((_PIXELS.float() / 255).to(memory_format=torch.channels_last), 1),
    (_PIXELS[:, :1].float().expand(1, 3, 40, 56) / 255, 1),  # a gray frame: one level a pixel
    (torch.zeros(1, 3, 40, 56), 1),  # a black frame
    ((_PIXELS // 4).float() * 3 - 7, 1),  # 64 levels, any scale and offset
], ids=["scaled", "uint8-times-scale", "normalised", "hwc-normalised", "float16", "bfloat16",
        "float64", "channels-last", "gray", "black", "64-levels"])
def test_an_image_from_8_bit_pixels_travels_palette_coded_and_decodes_to_its_exact_bits(
        t, groups):
    """Its data is a byte an element, plus ``groups`` palettes of 256 values, and the host
    gets the app's tensor back bit for bit, in the app's layout."""
    data, back = _sent(t)
    assert len(data.data) == t.numel()
    assert len(data.palette) == groups * codec.PALETTE_LEVELS * t.element_size()
    assert back.dtype == t.dtype and back.shape == t.shape and back.stride() == t.stride()
    assert torch.equal(_bits(back), _bits(t))


def _with(t: torch.Tensor, index: int, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[index] = value
    return t


@pytest.mark.parametrize("t", [
    torch.rand(1, 3, 40, 56),  # float data: no palette
    _with(_PIXELS.float() / 255, 5, 0.5),  # one value off the levels
    _with(_with(torch.zeros(1, 3, 40, 56), 5, -0.0), 6, 1.0),  # -0.0 beside 0.0: other bits
    _with(_PIXELS.float() / 255, 7, float("nan")),
    _with(_PIXELS.float() / 255, 7, float("inf")),
    (_PIXELS.float() / 255)[:, :, :8, :8],  # fewer elements than PALETTE_MIN
    _PIXELS, _PIXELS.int(),  # not floating: raw (integers are not coded)
    _PIXELS.float().sqrt(),  # 256 levels, not evenly spaced
], ids=["random", "off-level", "negative-zero", "nan", "inf", "small", "uint8", "int32",
        "uneven"])
def test_data_that_is_not_on_a_palette_travels_raw(t):
    data, back = _sent(t)
    assert not data.palette and len(data.data) == t.numel() * t.element_size()
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def _coded() -> ops_pb2.TensorData:
    data, _ = _sent((_PIXELS.float() / 255 - _MEAN) / _STD)
    return data


@pytest.mark.parametrize("edit,reason", [
    (lambda d: setattr(d, "palette", d.palette[:-4]), "palette of"),
    (lambda d: setattr(d, "palette", d.palette * 30), "palette of"),  # 90 groups
    (lambda d: setattr(d, "palette_block", 0), "whole blocks"),
    (lambda d: setattr(d, "palette_block", 11), "whole blocks"),
    (lambda d: setattr(d, "data", d.data[:-1]), "one an element"),
    (lambda d: setattr(d.meta, "dtype", "uint8"), "only floating"),
    (lambda d: d.meta.stride.extend([1, 1, 1, 1]), "strides"),
], ids=["short-palette", "too-many-groups", "block-0", "block-not-whole", "short-data",
        "integer-dtype", "bad-strides"])
def test_a_malformed_palette_coding_is_refused(edit, reason):
    data = _coded()
    edit(data)
    with pytest.raises(codec.CodecError, match=reason):
        codec.from_tensor_data(data)


def test_a_palette_decodes_whatever_its_values_are():
    """The host takes any palette (the shim's are fitted to images; another sender's need
    not be): each element is its group's entry, and a NaN or infinity in it is a value."""
    values = torch.tensor([float("nan"), float("inf"), -0.0, 1e30] * 64, dtype=torch.float32)
    data = ops_pb2.TensorData(meta=ops_pb2.TensorMeta(dtype="float32", shape=[2, 4]),
                              data=bytes([0, 1, 2, 3, 3, 2, 1, 0]),
                              palette=values.numpy().tobytes(), palette_block=1)
    back = codec.from_tensor_data(data)
    assert torch.equal(_bits(back), _bits(values[[0, 1, 2, 3, 3, 2, 1, 0]].view(2, 4)))


def test_an_input_that_was_not_on_a_palette_is_tried_again_only_every_so_many_uploads():
    """The replay client's memory per INPUT slot (``Sequence.codes``): float data fails the
    palette's try once, then goes raw untried for ``RETRY_PALETTE`` uploads (each try costs
    passes over the data), then is tried again; a slot whose data fits is tried every time."""
    from rrto_plugins.torch.replay import RETRY_PALETTE, Sequence

    seq = Sequence(ops_pb2.SequenceDef(), [], {}, {}, set())
    floats, image = torch.rand(1, 3, 40, 56), _PIXELS.float() / 255
    tried = []
    for _ in range(RETRY_PALETTE + 2):
        for slot, t in ((0, floats), (1, image)):
            code = seq.codes(slot)
            frame = codec.replay_upload(slot, t, {}, code)
            if code:
                seq.coded(slot, bool(frame.upload[3]))
            tried.append((slot, code, bool(frame.upload[3])))
    assert [code for slot, code, _ in tried if slot == 0] == \
        [True] + [False] * RETRY_PALETTE + [True]
    assert all(code and coded for slot, code, coded in tried if slot == 1)


def _upload_call(data: ops_pb2.TensorData) -> ops_pb2.OpCall:
    call = ops_pb2.OpCall(op="aten::mul.Tensor")
    call.args.add().tensor.upload.CopyFrom(data)
    return call


def test_a_palette_coded_upload_is_the_same_input_only_with_the_same_palette():
    """The robot's search marks an upload with the same bytes in every inference fixed
    (``SeqSource.fixed``). Palette-coded uploads (logged from replays that were cut) with the
    same levels but other palettes are other values: not fixed."""
    from rrtod.robot.oplog import LoggedCall
    from rrtod.robot.search import _same_upload

    coded, _ = _sent(_PIXELS.float() / 255)
    other = ops_pb2.TensorData()
    other.CopyFrom(coded)
    other.palette = (torch.frombuffer(bytearray(coded.palette), dtype=torch.float32) * 2
                     ).numpy().tobytes()

    def log(*uploads: ops_pb2.TensorData) -> list[LoggedCall]:
        return [LoggedCall(index=n, seq=n, op="aten::mul.Tensor", key=0, refs=(), outputs=(),
                           raw=_upload_call(u)) for n, u in enumerate(uploads)]

    assert _same_upload(log(coded, coded), [0, 1], 0, 0)
    assert not _same_upload(log(coded, other), [0, 1], 0, 0)


def test_a_fixed_input_recorded_palette_coded_is_compared_with_the_apps_raw_bytes():
    """A definition's fixed upload that is palette-coded (``_fixed_bytes``) is matched against
    the app's tensor by its decoded bytes; one that does not decode matches nothing."""
    from rrto_plugins.torch.replay import _fixed_bytes

    image = _PIXELS.float() / 255
    coded, _ = _sent(image)
    assert coded.palette and _fixed_bytes(coded) == image.numpy().tobytes()
    raw = codec.tensor_data(image)
    assert _fixed_bytes(raw) == raw.data
    coded.palette_block = 0
    assert _fixed_bytes(coded) is None


@pytest.mark.parametrize("t", [
    torch.randint(0, 21, (1, 64, 96)),  # a class map from argmax
    torch.randint(-1000, -745, (80, 80), dtype=torch.int32),  # any 256 consecutive values
    torch.full((4096,), 7, dtype=torch.int16),
    torch.randint(0, 21, (1, 96, 64)).transpose(1, 2),  # not contiguous
], ids=["class-map", "int32-offset", "int16-constant", "transposed"])
def test_an_integer_output_spanning_fewer_than_256_values_is_sent_a_byte_an_element(t):
    data = ops_pb2.TensorData.FromString(codec.tensor_data(t, code_ints=True).SerializeToString())
    assert len(data.data) == t.numel() and len(data.palette) == 256 * t.element_size()
    back = codec.from_tensor_data(data)
    assert back.dtype == t.dtype and torch.equal(back, t)


@pytest.mark.parametrize("t", [
    torch.randint(0, 256, (64, 64)),  # 256 values span 255: coded
    torch.randint(0, 257, (64, 64), generator=torch.Generator().manual_seed(3)),
    torch.randint(0, 21, (16, 16)),  # fewer than PALETTE_MIN elements
    torch.full((4096,), 2**15 - 10, dtype=torch.int16),  # its palette would overflow int16
    torch.randint(0, 2, (64, 64), dtype=torch.uint8),  # a byte already
], ids=["span-255", "span-256", "small", "near-max", "uint8"])
def test_integer_coding_only_where_it_fits(t):
    data = codec.tensor_data(t, code_ints=True)
    fits = t.dtype in (torch.int16, torch.int32, torch.int64) and t.numel() >= codec.PALETTE_MIN \
        and int(t.max()) - int(t.min()) < 256 and int(t.min()) + 255 <= torch.iinfo(t.dtype).max
    assert bool(data.palette) == fits
    assert torch.equal(codec.from_tensor_data(data), t)
    assert not codec.tensor_data(t).palette  # only where asked (the host's outputs)
