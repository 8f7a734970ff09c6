"""Keep the memory a daemon frees for its next allocations instead of handing it back.

glibc returns freed memory to the kernel: a chunk above the mmap threshold is unmapped when
freed, and the heap's free top is trimmed once it passes the trim threshold. A replay frees
an inference's values and allocates the next one's right after, so each inference then writes
into fresh pages, a page fault each (~2 us here): the GPU daemon's replay thread took 4 000 to
15 000 faults an inference in some benchmark rounds (resnet50: 141 ms of replay against 116
ms in the round without them; yolo-pose up to 9 900). With freed memory kept (the trim
threshold and the top pad raised, the mmap threshold at glibc's largest), two runs of
``--models yolo-pose,resnet50`` took at most 715 faults an inference. The daemon's resident
size then stays near its peak, as a CUDA caching allocator keeps device memory; the tensor
store's quota (``memory_quota``) still bounds what sessions hold. ``RRTO_KEEP_FREED=0`` leaves
glibc's defaults; elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from rrtod.switches import flag

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = 1 << 30  # free heap top kept before trimming
TOP_PAD = 64 << 20  # extra the heap grows by each time
MMAP_THRESHOLD = 32 << 20  # glibc's largest (64-bit): bigger chunks are mapped per allocation


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed memory; whether it did (glibc, and not switched
    off)."""
    if not flag("RRTO_KEEP_FREED", True):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    set_ = [mallopt(param, value) == 1 for param, value in (  # each, even if one is refused
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD))]
    return all(set_)
