"""Tensors and operator arguments <-> the wire messages of ``rrto.v1.ops``.

Both ends use this module so that the client and the host agree on one encoding. Tensor bytes
travel raw (C-contiguous, little-endian): no pickle, nothing executable. Tensor arguments are
encoded through a callback so that the client can turn proxies into store ids and local tensors
into uploads, and the host can turn refs back into its own tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from rrto.v1 import ops_pb2
from rrtod.wire import EncodedFrame, upload_frame

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
    m = ops_pb2.TensorMeta()
    fill_meta(m, t, device)
    return m


def fill_meta(m: ops_pb2.TensorMeta, t: torch.Tensor, device: str | None = None) -> None:
    """``meta_of`` written into ``m`` (a fresh one, such as ``outs.add()``): a reply built in
    place is not copied into its parent (the host answers ~190 calls of a detector's
    inference this way)."""
    m.dtype = DTYPE_NAMES[t.dtype]
    m.shape.extend(t.shape)
    m.stride.extend(t.stride())
    m.storage_offset = t.storage_offset()
    m.device = device if device is not None else str(t.device)
    m.requires_grad = t.requires_grad


def wire_layout(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides an upload of ``t`` names: those of a dense (non-overlapping, gap-free)
    layout that differs from the C-contiguous strides, else None (the default layout)."""
    stride = t.stride()
    if t.numel() == 0 or stride == contiguous_strides(tuple(t.shape)):
        return None
    try:
        return _wire_stride(tuple(t.shape), stride)
    except CodecError:  # overlapping or with gaps: the C-contiguous copy is all there is
        return None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-contiguous strides, as ``torch.empty(shape)`` has them (size-1 dimensions included)."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def _wire_stride(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides from the wire, checked: none, or a dense layout of ``shape`` (a permutation of
    the dimensions; size-1 dimensions may have any stride, as in torch). Anything else could
    make the receiver allocate more than the data or alias elements, so it is refused."""
    if not stride:
        return None
    if len(stride) != len(shape) or any(s < 0 for s in stride):
        raise CodecError(f"strides {list(stride)} do not fit shape {list(shape)}")
    step = 1
    for size, st in sorted((p for p in zip(shape, stride, strict=True) if p[0] != 1),
                           key=lambda p: p[1]):
        if st != step:
            raise CodecError(f"strides {list(stride)} are not a dense layout of shape "
                             f"{list(shape)}")
        step *= size
    return stride


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


def tensor_data(t: torch.Tensor, device: str | None = None,
                keep_layout: bool = False) -> ops_pb2.TensorData:
    """``t``'s value for the wire (moved to the CPU first if it lives elsewhere). The bytes are
    C-contiguous whatever the source strides were; ``keep_layout`` also sends the strides of a
    dense tensor whose layout is not C-contiguous (``wire_layout``), so that the receiver
    rebuilds the layout the app has: CPU kernels choose their summation order by strides, even
    those of size-1 dimensions (a ``[32, 1]`` matmul operand with strides ``(1, 32)`` and one
    with ``(1, 1)`` round differently)."""
    cpu = t.detach()
    if cpu.device.type != "cpu":
        cpu = cpu.cpu()
    meta = meta_of(cpu, device=device if device is not None else str(t.device))
    if not (keep_layout and wire_layout(cpu)):
        meta.ClearField("stride")
    meta.storage_offset = 0
    return ops_pb2.TensorData(meta=meta, data=bytes(raw_bytes(cpu)))


def replay_upload(slot: int, t: torch.Tensor, meta_cache: dict[Any, bytes]) -> EncodedFrame:
    """``SessionUp(arg=ReplayArg(slot, tensor=TensorRef(upload=tensor_data(t))))``, encoded
    without copying ``t``'s bytes (``wire.upload_frame``). ``meta_cache`` keeps the serialized
    metadata per (dtype, shape, device): an app's inputs have the same few, inference after
    inference (replay only uploads inputs with the metadata its sequences recorded, so the
    cache stays small)."""
    cpu = t.detach()
    if cpu.device.type != "cpu":
        cpu = cpu.cpu()
    layout = wire_layout(cpu)
    key = (cpu.dtype, tuple(cpu.shape), str(t.device), layout)
    meta = meta_cache.get(key)
    if meta is None:
        m = meta_of(cpu, device=key[2])
        if not layout:  # the bytes are C-contiguous; strides only for another dense layout
            m.ClearField("stride")
        m.storage_offset = 0
        m.requires_grad = False
        meta = meta_cache[key] = m.SerializeToString()
    return upload_frame(slot, meta, raw_bytes(cpu))


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
    # Allocated by torch, as the app's tensors are (64-byte aligned; a bytearray is 16), then
    # filled: one copy, as before, and vectorized kernels see the alignment they see locally.
    stride = _wire_stride(shape, tuple(meta.stride)) if numel else None
    if stride is None:
        out = torch.empty(shape, dtype=dtype)
    else:
        out = torch.empty_strided(shape, stride, dtype=dtype)
    if numel:
        with warnings.catch_warnings():  # read only: the message's bytes are never written
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(msg.data, dtype=torch.uint8)
        if stride is None:
            out.view(-1).view(torch.uint8).copy_(data)
        else:
            out.copy_(data.view(dtype).view(shape))
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
