"""Tensors and operator arguments <-> the wire messages of ``rrto.v1.ops``.

Both ends use this module so that the client and the host agree on one encoding. Tensor bytes
travel raw (C-contiguous, little-endian): no pickle, nothing executable. Tensor arguments are
encoded through a callback so that the client can turn proxies into store ids and local tensors
into uploads, and the host can turn refs back into its own tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from rrto.v1 import ops_pb2

# dtype <-> wire name (torch's own name without "torch.").
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
        torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
        torch.float8_e5m2, torch.complex32,
    )
}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}
LAYOUTS: dict[str, torch.layout] = {
    "strided": torch.strided, "sparse_coo": torch.sparse_coo, "sparse_csr": torch.sparse_csr,
}
LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}
MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d, "preserve_format": torch.preserve_format,
}
MEMORY_FORMAT_NAMES = {v: k for k, v in MEMORY_FORMATS.items()}


class CodecError(ValueError):
    """A value that this codec cannot express, or a wire value that is not valid."""


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown dtype {name!r}") from None


def meta_of(t: torch.Tensor, device: str | None = None) -> ops_pb2.TensorMeta:
    """Wire metadata of ``t`` (``device``: what the app believes, when it differs)."""
    return ops_pb2.TensorMeta(
        dtype=DTYPE_NAMES[t.dtype],
        shape=t.shape,
        stride=t.stride(),
        storage_offset=t.storage_offset(),
        device=device if device is not None else str(t.device),
        requires_grad=t.requires_grad,
    )


def nbytes_of(meta: ops_pb2.TensorMeta) -> int:
    n = 1
    for s in meta.shape:
        n *= s
    return n * dtype_of(meta.dtype).itemsize


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The C-contiguous bytes of a CPU tensor, without a copy when it already is contiguous."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def tensor_data(t: torch.Tensor, device: str | None = None) -> ops_pb2.TensorData:
    """``t``'s value for the wire (moved to the CPU first if it lives elsewhere)."""
    cpu = t.detach()
    if cpu.device.type != "cpu":
        cpu = cpu.cpu()
    meta = meta_of(cpu, device=device if device is not None else str(t.device))
    meta.ClearField("stride")  # the bytes are C-contiguous whatever the source strides were
    meta.storage_offset = 0
    return ops_pb2.TensorData(meta=meta, data=bytes(raw_bytes(cpu)))


def release_of(ids: Iterable[int]) -> ops_pb2.Release:
    """A ``Release`` of ``ids``, as gaps between the sorted ids: a replayed inference drops
    hundreds of ids near 2^52, which cost a byte each this way instead of eight."""
    gaps, last = [], 0
    for i in sorted(ids):
        gaps.append(i - last)
        last = i
    return ops_pb2.Release(gaps=gaps)  # read back by rrtod.robot.oplog.released_ids


class EncodedFrame:
    """A ``SessionUp`` already in wire form, as parts: the bytes of a large upload stay in the
    tensor's own memory until the socket copies them (building the message instead copies
    them once per nesting level, then to serialize: ~47 us for a 48 KiB input here, ~9 us
    this way). Channels that take messages get it back through ``SerializeToString``."""

    __slots__ = ("parts", "size", "kind")

    def __init__(self, parts: list[Any], kind: str):
        self.parts = parts
        self.size = sum(len(p) for p in parts)
        self.kind = kind

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf message method
        return b"".join(self.parts)

    def WhichOneof(self, name: str) -> str:  # noqa: N802
        return self.kind


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_key(message: Any, field: str) -> bytes:
    """The key of a length-delimited field (wire type 2), by its number in the schema."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


_ARG_KEY = _len_key(ops_pb2.SessionUp, "arg")
_SLOT_KEY = _varint(ops_pb2.ReplayArg.DESCRIPTOR.fields_by_name["slot"].number << 3)
_TENSOR_KEY = _len_key(ops_pb2.ReplayArg, "tensor")
_UPLOAD_KEY = _len_key(ops_pb2.TensorRef, "upload")
_META_KEY = _len_key(ops_pb2.TensorData, "meta")
_DATA_KEY = _len_key(ops_pb2.TensorData, "data")


def replay_upload(slot: int, t: torch.Tensor, meta_cache: dict[Any, bytes]) -> EncodedFrame:
    """``SessionUp(arg=ReplayArg(slot, tensor=TensorRef(upload=tensor_data(t))))``, encoded
    without copying ``t``'s bytes. ``meta_cache`` keeps the serialized metadata per (dtype,
    shape, device): an app's inputs have the same few, inference after inference (replay
    only uploads inputs with the metadata its sequences recorded, so the cache stays small)."""
    cpu = t.detach()
    if cpu.device.type != "cpu":
        cpu = cpu.cpu()
    key = (cpu.dtype, tuple(cpu.shape), str(t.device))
    meta = meta_cache.get(key)
    if meta is None:
        m = meta_of(cpu, device=key[2])
        m.ClearField("stride")  # the bytes are C-contiguous whatever the source strides were
        m.storage_offset = 0
        m.requires_grad = False
        meta = meta_cache[key] = m.SerializeToString()
    data = raw_bytes(cpu)
    tensor_data = _META_KEY + _varint(len(meta)) + meta + _DATA_KEY + _varint(len(data))
    size = len(tensor_data) + len(data)
    ref = _UPLOAD_KEY + _varint(size)
    size += len(ref)
    arg = _SLOT_KEY + _varint(slot) + _TENSOR_KEY + _varint(size)
    size += len(arg)
    head = _ARG_KEY + _varint(size) + arg + ref + tensor_data
    return EncodedFrame([head, data] if len(data) else [head], "arg")


def from_tensor_data(msg: ops_pb2.TensorData, device: str | torch.device = "cpu") -> torch.Tensor:
    """A fresh, writable tensor holding ``msg``'s value, on ``device``."""
    meta = msg.meta
    dtype = dtype_of(meta.dtype)
    shape = tuple(meta.shape)
    if any(s < 0 for s in shape):
        raise CodecError(f"negative dimension in shape {shape}")
    numel = 1
    for s in shape:
        numel *= s
    if len(msg.data) != numel * dtype.itemsize:
        raise CodecError(
            f"tensor data has {len(msg.data)} bytes, expected {numel * dtype.itemsize} "
            f"for {meta.dtype}{list(shape)}"
        )
    if numel == 0:
        out = torch.empty(shape, dtype=dtype)
    else:
        out = torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)
    if str(device) != "cpu":
        out = out.to(device)
    return out


TensorEncoder = Callable[[torch.Tensor], ops_pb2.TensorRef]
TensorDecoder = Callable[[ops_pb2.TensorRef], torch.Tensor]


def encode_value(value: Any, out: ops_pb2.Value, tensor: TensorEncoder) -> None:
    """Fill ``out`` with ``value``. Tensors go through ``tensor``; unsupported types raise
    CodecError (the client then runs the operator locally instead)."""
    # bool before int: bool is an int subclass.
    if value is None:
        out.none = True
    elif isinstance(value, torch.Tensor):
        out.tensor.CopyFrom(tensor(value))
    elif isinstance(value, bool):
        out.b = value
    elif isinstance(value, int):
        out.i = value
    elif isinstance(value, float):
        out.f = value
    elif isinstance(value, str):
        out.s = value
    elif isinstance(value, (list, tuple)):
        items = out.tuple.items if isinstance(value, tuple) else out.list.items
        if not value:  # an empty list/tuple must still select the oneof field
            (out.tuple if isinstance(value, tuple) else out.list).SetInParent()
        for item in value:
            encode_value(item, items.add(), tensor)
    elif isinstance(value, torch.dtype):
        out.dtype = DTYPE_NAMES[value]
    elif isinstance(value, torch.device):
        out.device = str(value)
    elif isinstance(value, torch.layout):
        try:
            out.layout = LAYOUT_NAMES[value]
        except KeyError:
            raise CodecError(f"unsupported layout {value}") from None
    elif isinstance(value, torch.memory_format):
        out.memory_format = MEMORY_FORMAT_NAMES[value]
    elif isinstance(value, complex):
        out.c.real, out.c.imag = value.real, value.imag
    elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise CodecError("symbolic values cannot be forwarded")
    else:
        raise CodecError(f"cannot forward a value of type {type(value).__name__}")


def decode_value(msg: ops_pb2.Value, tensor: TensorDecoder, device: Callable[[str], Any]) -> Any:
    """The Python value of ``msg``. ``device`` maps the app's device names to the host's."""
    kind = msg.WhichOneof("kind")
    if kind is None or kind == "none":
        return None
    if kind == "tensor":
        return tensor(msg.tensor)
    if kind == "list":
        return [decode_value(v, tensor, device) for v in msg.list.items]
    if kind == "tuple":
        return tuple(decode_value(v, tensor, device) for v in msg.tuple.items)
    if kind == "dtype":
        return dtype_of(msg.dtype)
    if kind == "device":
        return device(msg.device)
    if kind == "layout":
        try:
            return LAYOUTS[msg.layout]
        except KeyError:
            raise CodecError(f"unknown layout {msg.layout!r}") from None
    if kind == "memory_format":
        try:
            return MEMORY_FORMATS[msg.memory_format]
        except KeyError:
            raise CodecError(f"unknown memory format {msg.memory_format!r}") from None
    if kind == "c":
        return complex(msg.c.real, msg.c.imag)
    return getattr(msg, kind)  # b, i, f, s
