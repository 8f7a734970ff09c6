"""Operator names as the GPU host's configuration writes them, checked without importing torch.

An entry of ``executor.allow_extra`` or ``executor.deny`` is a qualified overload name
(``aten::add.Tensor``), an operator name covering all its overloads (``aten::add``), or a whole
namespace (``torchvision::*``). Some operators are *internal or unsafe*: they build views of any
size over a storage (``aten::_reshape_alias``), skip bounds checks (``aten::_unsafe_index``),
rebind raw storages (``aten::set_``), touch files, streams or process-global state, or build
layouts whose metadata the host cannot validate (nested, mkldnn, sparse internals). The built-in
allowlist never admits them, and ``allow_extra`` admits one only when the entry says so in
writing: ``unsafe:aten::_reshape_alias``. The daemon's config validation uses ``check_entry``
so that an unmarked unsafe entry is refused at load time, naming file, key and reason.
"""

from __future__ import annotations

import re

UNSAFE_MARKER = "unsafe:"

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_NAMESPACE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::\*$")

# Base operator names (no namespace, no overload) that are internal or unsafe, and why. A
# trailing underscore (in-place variant) is stripped before matching.
_UNSAFE_EXACT: dict[str, str] = {
    "_reshape_alias": "builds a view of any size over the storage (reads the host's heap)",
    "_reshape_alias_copy": "builds a view of any size over the storage (reads the host's heap)",
    "as_strided": "builds a view of any size, strides and offset over the storage (torch's own "
                  "check overflows: as_strided_ accepts sizes [3] with strides [2**62])",
    "as_strided_copy": "builds a view of any size, strides and offset over the storage",
    "as_strided_scatter": "writes through a view of any size, strides and offset",
    "set": "rebinds raw storages",
    "set_data": "rebinds raw storages",
    "from_file": "reads a file on the host",
    "save": "writes a file on the host",
    "_print": "writes to the host's stdout",
    "_sleep": "blocks the host's worker",
    "record_stream": "changes the host's CUDA stream bookkeeping",
    "_index_put_impl": "has an unsafe flag that skips bounds checks",
    "_copy_from": "internal copy between backends, no shape checks",
    "_copy_from_and_resize": "internal copy between backends, no shape checks",
    "_efficientzerotensor": "a tensor without storage behind its shape",
    "_make_per_tensor_quantized_tensor": "reinterprets a storage as quantized data",
    "_make_per_channel_quantized_tensor": "reinterprets a storage as quantized data",
    "_assert_async": "aborts the host's CUDA context on failure",
    "_cufft_set_plan_cache_max_size": "process-global state",
    "_cufft_clear_plan_cache": "process-global state",
    "_set_cached_tensors_enabled": "process-global state",
    "_add_cached_tensor": "process-global state",
    "_remove_cached_tensor": "process-global state",
}
# Prefixes and patterns of internal operator families, and why.
_UNSAFE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"unsafe"), "skips checks its safe counterpart makes"),
    (re.compile(r"^_nested_|^nested_"), "nested-tensor internals: offsets not validated"),
    (re.compile(r"jagged"), "jagged-tensor internals: offsets not validated"),
    (re.compile(r"^_?mkldnn_"), "mkldnn layout internals"),
    (re.compile(r"^_sparse_|^_validate_sparse_|^sparse_(coo|csr|csc|bsr|bsc|compressed)_tensor"),
     "sparse constructors and internals: indices not validated"),
    (re.compile(r"^_?cufft_|^_cuda_|^_cudnn_rnn_flatten"), "process-global CUDA state"),
)

# Internal-looking names that real models send and that are memory-safe, reviewed one by one:
# the positive allowlist may list them (tests/test_allowlist.py checks nothing else slips in).
REVIEWED_SAFE: dict[str, str] = {
    "_unsafe_view": "checks its size against the input's element count exactly as view does; "
                    "'unsafe' refers only to autograd's view tracking (matmul sends it)",
    "unsafe_split": "split without autograd view tracking; bounds checked as split",
    "unsafe_chunk": "chunk without autograd view tracking; bounds checked as chunk",
    "unsafe_split_with_sizes": "split_with_sizes without autograd view tracking; checked sizes",
}


def split(name: str) -> tuple[str, str, str]:
    """``ns::op.overload`` -> (ns, op, overload); overload ``default`` when absent."""
    ns, _, rest = name.partition("::")
    op, _, overload = rest.partition(".")
    return ns, op, overload or "default"


def is_name(name: str) -> bool:
    """A syntactically valid ``ns::op`` or ``ns::op.overload``."""
    return bool(_NAME.match(name))


def unsafe_reason(name: str) -> str | None:
    """Why operator ``name`` (``ns::op[.overload]``) is internal or unsafe, or None when not."""
    _, op, _ = split(name)
    base = op.rstrip("_") or op
    if base in REVIEWED_SAFE or op in REVIEWED_SAFE:
        return None
    why = _UNSAFE_EXACT.get(base)
    if why is not None:
        return why
    for pattern, why in _UNSAFE_PATTERNS:
        if pattern.search(base):
            return why
    return None


def parse_entry(entry: str) -> tuple[str, bool]:
    """``unsafe:ns::op`` -> (``ns::op``, True); ``ns::op`` -> (``ns::op``, False)."""
    if entry.startswith(UNSAFE_MARKER):
        return entry[len(UNSAFE_MARKER):], True
    return entry, False


def check_entry(entry: object, *, extra: bool) -> str | None:
    """Why a config entry of ``allow_extra`` (``extra``) or ``deny`` is invalid, or None."""
    if not isinstance(entry, str):
        return f"expected an operator name such as aten::add.Tensor, got {entry!r}"
    name, marked = parse_entry(entry)
    if marked and not extra:
        return f"{entry!r}: the {UNSAFE_MARKER!r} marker belongs in allow_extra, not deny"
    if not (is_name(name) or _NAMESPACE.match(name)):
        return (f"{entry!r} is not an operator name (expected ns::op, ns::op.overload or "
                f"ns::*)")
    if not extra:
        return None
    if name.endswith("::*"):
        if marked:
            return f"{entry!r}: unsafe operators are enabled one by one, not by namespace"
        return None
    why = unsafe_reason(name)
    if why is not None and not marked:
        return (f"{name} is internal or unsafe ({why}); enable it only deliberately, "
                f"written as '{UNSAFE_MARKER}{name}'")
    if marked and why is None:
        return f"{name} is not an unsafe operator: drop the {UNSAFE_MARKER!r} marker"
    return None
