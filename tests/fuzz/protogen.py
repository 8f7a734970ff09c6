"""Structure-aware protobuf inputs for the fuzzers: a message built field by field from the
fuzzer's bytes, following the message's descriptor.

Random bytes rarely parse as a deep message (a ``SessionUp`` holding an ``OpCall`` whose
argument is an upload with a matching shape and data), so most of a byte fuzzer's inputs would
stop at the parser. Building the message from the input instead (what libprotobuf-mutator does;
its Python bindings have no wheel for Python 3.11) keeps every input a valid message whose
values the coverage-guided mutation then steers. Strings and integers are drawn partly from
dictionaries of values that matter to the decoders (operator names, dtypes, boundary sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message

OPS = [
    "aten::add.Tensor", "aten::mul.Tensor", "aten::relu.default", "aten::relu_.default",
    "aten::neg.default", "aten::clone.default", "aten::view.default", "aten::reshape",
    "aten::linear.default", "aten::addmm.default", "aten::cat.default", "aten::sum.dim_IntList",
    "aten::t.default", "aten::empty.memory_format", "aten::ones.default", "aten::zeros.default",
    "aten::copy_.default", "aten::add_.Tensor", "aten::slice.Tensor", "aten::select.int",
    "aten::_to_copy.default", "aten::detach.default", "aten::unknown.op", "prim::bind",
    "rrto::bind", "builtins::eval", "aten::save", "",
]
DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool",
          "complex64", "qint8", "float8_e4m3fn", "object", ""]
WORDS = ["cpu", "cuda", "cuda:0", "meta", "mps", "torch", "echo", "status", "plugins",
         "sequences", "flush", "reload", "all", "app", "1", "strided", "sparse_coo",
         "contiguous_format", "channels_last", "preserve_format", "../../etc/passwd", "\x00"]
INTS = [0, 1, 2, 3, 4, 8, -1, -2, 255, 256, 2**16, 2**31 - 1, -(2**31), 2**32, 2**62, 2**63 - 1,
        -(2**63), 1 << 40]
RANGES = {FD.TYPE_INT32: (-(2**31), 2**31 - 1), FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
          FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FD.TYPE_INT64: (-(2**63), 2**63 - 1),
          FD.TYPE_SINT64: (-(2**63), 2**63 - 1), FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
          FD.TYPE_UINT32: (0, 2**32 - 1), FD.TYPE_FIXED32: (0, 2**32 - 1),
          FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1)}


class Builder:
    """Builds messages from a ``FuzzedDataProvider``; ``budget`` bounds the fields per input."""

    def __init__(self, fdp: Any, budget: int = 200, max_depth: int = 6,
                 schema_of: Callable[[str], bytes | None] | None = None):
        self.fdp = fdp
        self.budget = budget
        self.max_depth = max_depth
        # The host's own schema hash of an operator name (None: no such operator): an OpCall's
        # ``schema`` then sometimes matches, so the paths past the schema check are reached too.
        self.schema_of = schema_of

    def build(self, cls: type[Message]) -> Message:
        msg = cls()
        self.fill(msg, 0)
        return msg

    def fill(self, msg: Message, depth: int) -> None:
        fdp = self.fdp
        chosen_oneofs = {}
        for oneof in msg.DESCRIPTOR.oneofs:
            options = list(oneof.fields)
            pick = fdp.ConsumeIntInRange(0, len(options))
            chosen_oneofs[oneof.name] = options[pick] if pick < len(options) else None
        for field in msg.DESCRIPTOR.fields:
            if self.budget <= 0 or fdp.remaining_bytes() == 0:
                return
            oneof = field.containing_oneof
            if oneof is not None and not oneof.name.startswith("_"):
                if chosen_oneofs.get(oneof.name) is not field:
                    continue
            elif not fdp.ConsumeBool():
                continue
            self.budget -= 1
            if field.type == FD.TYPE_MESSAGE and depth >= self.max_depth:
                continue
            if field.is_repeated:
                self._repeated(msg, field, depth)
            elif field.type == FD.TYPE_MESSAGE:
                sub = getattr(msg, field.name)
                sub.SetInParent()
                self.fill(sub, depth + 1)
            else:
                setattr(msg, field.name, self.scalar(field))
        if self.schema_of is not None and msg.DESCRIPTOR.name == "OpCall" and msg.schema \
                and fdp.ConsumeBool():
            msg.schema = self.schema_of(msg.op) or msg.schema

    def _repeated(self, msg: Message, field: Any, depth: int) -> None:
        count = self.fdp.ConsumeIntInRange(0, 4)
        container = getattr(msg, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            key_f, value_f = entry.fields_by_name["key"], entry.fields_by_name["value"]
            for _ in range(count):
                key = self.scalar(key_f)
                if value_f.type == FD.TYPE_MESSAGE:
                    self.fill(container[key], depth + 1)
                else:
                    container[key] = self.scalar(value_f)
            return
        for _ in range(count):
            if field.type == FD.TYPE_MESSAGE:
                self.fill(container.add(), depth + 1)
            else:
                container.append(self.scalar(field))

    def scalar(self, field: Any) -> Any:
        fdp = self.fdp
        t = field.type
        if t == FD.TYPE_BOOL:
            return fdp.ConsumeBool()
        if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
        if t == FD.TYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
            return fdp.PickValueInList(values) if fdp.ConsumeIntInRange(0, 7) else (
                fdp.ConsumeIntInRange(-5, 100))
        if t == FD.TYPE_STRING:
            mode = fdp.ConsumeIntInRange(0, 4)
            if mode == 0:
                return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 24))
            return fdp.PickValueInList([OPS, DTYPES, WORDS, WORDS][mode - 1])
        if t == FD.TYPE_BYTES:
            return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 96))
        lo, hi = RANGES[t]
        if fdp.ConsumeIntInRange(0, 3) == 0:
            return min(max(fdp.PickValueInList(INTS), lo), hi)
        return min(max(fdp.ConsumeIntInRange(-2, 24), lo), hi)
