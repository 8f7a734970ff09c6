"""Tensors and operator arguments <-> the wire messages of ``rrto.v1.ops``.

Both ends use this module so that the client and the host agree on one encoding. Tensor bytes
travel raw (C-contiguous, little-endian): no pickle, nothing executable. Tensor arguments are
encoded through a callback so that the client can turn proxies into store ids and local tensors
into uploads, and the host can turn refs back into its own tensors.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

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


# Palette coding (``TensorData.palette``): 256 levels a group, at most this many groups
# on the wire (the encoder makes 1, or one per channel of an image: 3 or 4).
PALETTE_LEVELS = 256
MAX_PALETTE_GROUPS = 64
# The encoder tries tensors of at least this many elements: below, a few hundred bytes saved
# do not pay for its passes over the data.
PALETTE_MIN = 4096
SAMPLE = 2048  # elements a group whose levels make the palette before every element is checked
# Integer dtypes wider than a byte, palette-coded where their values span fewer than 256
# (``int_palette_of``); the host codes the outputs it sends so.
_WIDE_INTS = frozenset({torch.int16, torch.int32, torch.int64})
# Per floating dtype: the integer type of its bits, and the constant whose addition rounds a
# value in [0, 2**22) (2**51 for float64) to an integer held in the low bits of its mantissa.
_BITS: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.int32, torch.float64: torch.int64,
    torch.float16: torch.int16, torch.bfloat16: torch.int16,
}
_ROUNDING = {torch.float32: (1.5 * 2**23, 0x4B400000, torch.int32),
             torch.float64: (1.5 * 2**52, 0x4338000000000000, torch.int64)}


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


def tensor_data(t: torch.Tensor, device: str | None = None, keep_layout: bool = False,
                code_ints: bool = False) -> ops_pb2.TensorData:
    """``t``'s value for the wire (moved to the CPU first if it lives elsewhere). The bytes are
    C-contiguous whatever the source strides were; ``keep_layout`` also sends the strides of a
    dense tensor whose layout is not C-contiguous (``wire_layout``), so that the receiver
    rebuilds the layout the app has: CPU kernels choose their summation order by strides, even
    those of size-1 dimensions (a ``[32, 1]`` matmul operand with strides ``(1, 32)`` and one
    with ``(1, 1)`` round differently). ``code_ints``: an integer tensor whose values span
    fewer than 256 goes palette-coded (``int_palette_of``; the host's outputs)."""
    cpu = t.detach()
    if cpu.device.type != "cpu":
        cpu = cpu.cpu()
    meta = meta_of(cpu, device=device if device is not None else str(t.device))
    if not (keep_layout and wire_layout(cpu)):
        meta.ClearField("stride")
    meta.storage_offset = 0
    coded = int_palette_of(cpu) if code_ints else None
    if coded is not None:
        return ops_pb2.TensorData(meta=meta, data=coded.indices.numpy().tobytes(),
                                  palette=coded.table.numpy().tobytes(), palette_block=1)
    return ops_pb2.TensorData(meta=meta, data=bytes(raw_bytes(cpu)))


class Palette(NamedTuple):
    """A tensor palette-coded (``palette_of``): a byte per element (C-contiguous order), and
    ``groups`` of ``PALETTE_LEVELS`` values, element e taking group (e // block) % groups."""

    indices: torch.Tensor  # uint8, flat
    table: torch.Tensor  # groups * PALETTE_LEVELS values of the tensor's dtype
    block: int


def palette_of(t: torch.Tensor) -> Palette | None:
    """``t`` palette-coded, if every element is exactly a value of its group's palette, else
    None (then it travels raw). The palettes tried are those of an image made from 8-bit
    pixels: values an affine image of at most 256 evenly spaced levels, over the whole tensor
    (scaled to [0, 1]) or per channel (normalised by a mean and deviation each: NCHW's channel
    dimension, or a last dimension of 2-4 as in HWC). The levels are fitted from each group's
    minimum and maximum and the coding is then checked bit for bit, so a value that is not on
    its palette (any float data; a NaN; -0.0 beside 0.0) leaves the tensor raw: decoding
    always gives back exactly ``t``'s bits. A strided sample is checked first, so that data
    that is not such an image costs less than a coding (on one of this machine's cores: ~0.5
    ms a 128x128 frame either way, 1.3 against 3.7 ms a 640x640 one; ``bench.uploads``)."""
    bits_dtype = _BITS.get(t.dtype)
    if bits_dtype is None or t.numel() < PALETTE_MIN:
        return None
    flat = _flat(t)
    for groups, block in _groupings(tuple(t.shape)):
        coded = _palette_coded(flat, groups, block, bits_dtype)
        if coded is not None:
            return coded
    return None


def int_palette_of(t: torch.Tensor) -> Palette | None:
    """An integer tensor of at least ``PALETTE_MIN`` elements whose values span fewer than
    256 (a segmentation's class map from ``argmax``, labels, indices into a small table),
    palette-coded: each element its distance from the least, a byte, and the palette the 256
    values from the least on. Exact by construction; one pass finds the span."""
    if t.dtype not in _WIDE_INTS or t.numel() < PALETTE_MIN:
        return None
    flat = _flat(t)
    lo_t, hi_t = torch.aminmax(flat)
    lo, hi = int(lo_t), int(hi_t)
    info = torch.iinfo(t.dtype)
    if hi - lo >= PALETTE_LEVELS or lo + PALETTE_LEVELS - 1 > info.max:
        return None  # (a palette's last entries must exist in the dtype too)
    indices = flat.sub(lo).to(torch.uint8)
    return Palette(indices, torch.arange(lo, lo + PALETTE_LEVELS, dtype=t.dtype), 1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the CPU, flat in C-contiguous order (a copy only where needed)."""
    x = t.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    if x.is_neg():  # (a lazy negation: its bits are not its values')
        x = x.resolve_neg()
    return x.contiguous().reshape(-1)


def _groupings(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(groups, block) to try: the whole tensor, then per channel (NCHW's, then a last one)."""
    out = [(1, 1)]
    if len(shape) >= 3 and 1 < shape[-3] <= 4:
        out.append((shape[-3], shape[-2] * shape[-1]))
    if len(shape) >= 2 and 1 < shape[-1] <= 4:
        out.append((shape[-1], 1))
    return out


def _palette_coded(flat: torch.Tensor, groups: int, block: int,
                   bits_dtype: torch.dtype) -> Palette | None:
    """``flat`` coded with ``groups`` palettes taking turns every ``block`` elements, or None.
    Each element's level is read off the fit (rounded by adding a constant, ``_ROUNDING``);
    the palette is what the elements of a sample hold at their levels, and every element must
    then hold exactly its level's entry. Levels the sample missed are taken from all the
    elements before giving up. The full passes write into per-thread buffers kept between
    uploads (``_SCRATCH``): a fresh buffer of a 640x640 frame's size costs more in page
    faults than the pass that fills it."""
    x = flat.view(-1, groups, block)
    work = x if x.dtype in _ROUNDING else x.float()  # (half types: levels found in float32)
    if groups == 1:
        lo_t, hi_t = torch.aminmax(work)
        lo, hi = [float(lo_t)], [float(hi_t)]
    else:
        lo, hi = work.amin(dim=(0, 2)).tolist(), work.amax(dim=(0, 2)).tolist()
    if not all(math.isfinite(v) for v in (*lo, *hi)):
        return None
    magic, magic_bits, int_dtype = _ROUNDING[work.dtype]
    scale = [(PALETTE_LEVELS - 1) / (h - low) if h > low else 0.0
             for low, h in zip(lo, hi, strict=True)]
    shift = [magic - low * sc for low, sc in zip(lo, scale, strict=True)]
    if groups == 1:
        factor: Any = scale[0]
        offset: Any = shift[0]
    else:
        factor = torch.tensor(scale, dtype=work.dtype).view(1, groups, 1)
        offset = torch.tensor(shift, dtype=work.dtype).view(1, groups, 1)
    first = (torch.arange(groups, dtype=int_dtype) * PALETTE_LEVELS).view(1, groups, 1)

    def levels(part: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each element's index into the table (its group's first entry + its level)."""
        rounded = torch.mul(part, factor, out=out.view(work.dtype).view(part.shape)) \
            if out is not None else part.mul(factor)
        level = rounded.add_(offset).view(int_dtype).sub_(magic_bits).clamp_(
            0, PALETTE_LEVELS - 1)
        return level.add_(first) if groups > 1 else level

    m = x.shape[0]
    across = max(1, block // SAMPLE)  # a sample of ~SAMPLE elements a group
    down = max(1, m * -(-block // across) // SAMPLE)
    sample_bits = x[::down, :, ::across].contiguous().view(bits_dtype).reshape(-1)
    sample_at = levels(work[::down, :, ::across]).reshape(-1)
    # Entries no element has set are all ones, a NaN, which no element here can be (a NaN
    # makes the fit's bounds NaN): an element at a level the sample missed never matches one.
    table = torch.full((groups * PALETTE_LEVELS,), -1, dtype=bits_dtype)
    table.scatter_(0, sample_at.to(torch.int64), sample_bits)
    if not torch.equal(table.index_select(0, sample_at), sample_bits):
        return None  # (most data that is not on a palette fails here)
    n = flat.numel()
    at = levels(work, _SCRATCH.get("levels", n, int_dtype)).view(-1)
    bits = flat.view(bits_dtype)
    got = torch.index_select(table, 0, at, out=_SCRATCH.get("check", n, bits_dtype))
    if not torch.equal(got, bits):
        # Elements at levels the sample missed (a rare shade) take those levels' entries;
        # any other element that differs from its entry is off the palette.
        wrong = torch.ne(got, bits).nonzero().view(-1)
        if wrong.numel() > n // 8:
            return None
        missed, their_bits = at[wrong], bits[wrong]
        if (table.index_select(0, missed) != -1).any():
            return None  # a level the sample met holds another value here
        table.scatter_(0, missed.to(torch.int64), their_bits)
        if not torch.equal(table.index_select(0, missed), their_bits):
            return None
    indices = at.bitwise_and_(PALETTE_LEVELS - 1).to(torch.uint8)  # (the group's first: 256 k)
    return Palette(indices, table.view(flat.dtype), block)


class _Scratch(threading.local):
    """Per thread, the buffers ``_palette_coded`` writes its full passes into, by role and
    dtype; each grows to the largest upload met (two of a 640x640 frame's size: ~10 MB)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get((role, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.buffers[(role, dtype)] = torch.empty(numel, dtype=dtype)
        return buf[:numel]


_SCRATCH = _Scratch()


def _from_palette(msg: ops_pb2.TensorData, dtype: torch.dtype, numel: int,
                  device: str | torch.device) -> torch.Tensor:
    """The ``numel`` values (flat, C-contiguous order) of palette-coded ``msg``, decoded on
    ``device``; every field checked, so that any message decodes or raises CodecError."""
    if dtype not in _BITS and dtype not in _WIDE_INTS:
        raise CodecError(f"a palette of {msg.meta.dtype}: only floating dtypes and integers "
                         "of 2-8 bytes are coded so")
    entry = PALETTE_LEVELS * dtype.itemsize
    groups, rest = divmod(len(msg.palette), entry)
    if rest or not 1 <= groups <= MAX_PALETTE_GROUPS:
        raise CodecError(f"a palette of {len(msg.palette)} bytes is not 1-"
                         f"{MAX_PALETTE_GROUPS} groups of {PALETTE_LEVELS} {msg.meta.dtype}")
    block = msg.palette_block
    if block < 1 or numel % (groups * block):
        raise CodecError(f"{numel} elements are not whole blocks of {block} in {groups} groups")
    if len(msg.data) != numel:
        raise CodecError(f"palette-coded data has {len(msg.data)} bytes, expected {numel} "
                         f"(one an element)")
    if not numel:
        return torch.empty(0, dtype=dtype, device=device)
    with warnings.catch_warnings():  # read only: the message's bytes are never written
        warnings.simplefilter("ignore", UserWarning)
        indices = torch.frombuffer(msg.data, dtype=torch.uint8).to(device)
        table = torch.frombuffer(msg.palette, dtype=torch.uint8).to(device).view(dtype)
    where = indices.to(torch.int64)
    if groups > 1:
        offsets = torch.arange(groups, dtype=torch.int64, device=where.device)
        where = where.view(-1, groups, block).add_((offsets * PALETTE_LEVELS).view(1, groups, 1))
    return table.index_select(0, where.reshape(-1))


def replay_upload(slot: int, t: torch.Tensor, meta_cache: dict[Any, bytes],
                  code: bool = True) -> EncodedFrame:
    """``SessionUp(arg=ReplayArg(slot, tensor=TensorRef(upload=tensor_data(t))))``, encoded
    without copying ``t``'s bytes (``wire.upload_frame``), palette-coded where ``code`` and
    its values allow (``palette_of``). ``meta_cache`` keeps the serialized metadata per
    (dtype, shape, device): an app's inputs have the same few, inference after inference
    (replay only uploads inputs with the metadata its sequences recorded, so the cache stays
    small)."""
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
    coded = palette_of(cpu) if code else None
    if coded is not None:
        return upload_frame(slot, meta, memoryview(coded.indices.numpy()).cast("B"),
                            bytes(raw_bytes(coded.table)), coded.block)
    return upload_frame(slot, meta, raw_bytes(cpu))


def from_tensor_data(msg: ops_pb2.TensorData, device: str | torch.device = "cpu") -> torch.Tensor:
    """A fresh, writable tensor holding ``msg``'s value, on ``device``."""
    meta = msg.meta
    dtype = dtype_of(meta.dtype)
    shape = tuple(meta.shape)
    if any(s < 0 for s in shape):
        raise CodecError(f"negative dimension in shape {shape}")
    numel, extent = 1, 1
    for s in shape:
        numel *= s
        extent *= max(s, 1)
    if extent >= 1 << 63:  # (an empty tensor too: torch works out its strides all the same)
        raise CodecError(f"shape {list(shape)} overflows a tensor's strides")
    stride = _wire_stride(shape, tuple(meta.stride)) if numel else None
    if msg.palette:
        values = _from_palette(msg, dtype, numel, device)
        if stride is None:
            return values.view(shape)
        return torch.empty_strided(shape, stride, dtype=dtype,
                                   device=values.device).copy_(values.view(shape))
    if len(msg.data) != numel * dtype.itemsize:
        raise CodecError(
            f"tensor data has {len(msg.data)} bytes, expected {numel * dtype.itemsize} "
            f"for {meta.dtype}{list(shape)}"
        )
    # Allocated by torch, as the app's tensors are (64-byte aligned; a bytearray is 16), then
    # filled: one copy, as before, and vectorized kernels see the alignment they see locally.
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
