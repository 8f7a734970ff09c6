"""The GPU daemon's content-addressed weight cache on disk.

Persistent tensors (parameters, buffers) are named by a hash of their content, so a restarted app
offers the same names and uploads nothing the host already has. Each blob is one file holding a
serialized ``TensorData`` under ``root/<2 hex>/<32 hex>``; writes go to a temporary file and are
renamed into place, so a crash never leaves a half blob under a valid name. The cache is bounded:
the least recently used blobs (file mtime, bumped on every read, so the order survives restarts)
are evicted when a put would exceed ``max_bytes``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import xxhash

from rrto.v1 import ops_pb2

HASH_BYTES = 16


class BlobError(ValueError):
    """A blob that does not match its name, or one the cache cannot hold."""


def content_hash(dtype: str, shape: list[int] | tuple[int, ...], data: bytes | memoryview) -> bytes:
    """xxh3-128 over the dtype, the shape and the raw C-contiguous bytes.

    dtype and shape are part of the name because the same bytes reinterpreted are another tensor.
    """
    h = xxhash.xxh3_128()
    h.update(f"{dtype}:{','.join(str(int(s)) for s in shape)};".encode())
    h.update(data)
    return h.digest()


def hash_of(tensor: ops_pb2.TensorData) -> bytes:
    return content_hash(tensor.meta.dtype, list(tensor.meta.shape), tensor.data)


class BlobStore:
    """``has``/``put``/``get`` by content hash; thread-safe (sessions and the unary service)."""

    def __init__(self, root: Path, max_bytes: int):
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> size, LRU first
        self._bytes = 0
        self._scan()

    # -- index -------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name[2:]

    def _scan(self) -> None:
        """Rebuild the LRU index from the files a previous run left (oldest mtime first)."""
        found: list[tuple[float, bytes, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                if f.name.startswith("."):  # an interrupted write: never valid
                    f.unlink(missing_ok=True)
                    continue
                try:
                    key = bytes.fromhex(sub.name + f.name)
                    st = f.stat()
                except (ValueError, OSError):
                    continue
                if len(key) == HASH_BYTES:
                    found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        self._evict(0)

    def _evict(self, incoming: int) -> None:
        while self._index and self._bytes + incoming > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._path(key).unlink(missing_ok=True)

    # -- API ---------------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def missing(self, keys: list[bytes]) -> list[bytes]:
        with self._lock:
            return [k for k in keys if k not in self._index]

    def put(self, key: bytes, tensor: ops_pb2.TensorData) -> None:
        """Store ``tensor`` under ``key`` after checking that ``key`` is its content hash.
        Raises BlobError on a mismatch or when the blob alone exceeds the cache size."""
        if len(key) != HASH_BYTES or hash_of(tensor) != key:
            raise BlobError(f"blob {key.hex()} does not match its content hash")
        payload = tensor.SerializeToString()
        if len(payload) > self.max_bytes:
            raise BlobError(
                f"blob {key.hex()} of {len(payload)} bytes exceeds the weight cache size "
                f"({self.max_bytes} bytes)"
            )
        path = self._path(key)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            self._evict(len(payload))
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
            with open(tmp, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._index[key] = len(payload)
            self._bytes += len(payload)

    def get(self, key: bytes) -> ops_pb2.TensorData | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
            path = self._path(key)
            try:
                payload = path.read_bytes()
                now = time.time()
                os.utime(path, (now, now))
            except OSError:  # removed behind our back: forget it
                self._bytes -= self._index.pop(key)
                return None
        tensor = ops_pb2.TensorData()
        tensor.ParseFromString(payload)
        if hash_of(tensor) != key:  # disk corruption: never hand out wrong weights
            with self._lock:
                if key in self._index:
                    self._bytes -= self._index.pop(key)
                path.unlink(missing_ok=True)
            return None
        return tensor

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"blobs": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes}
