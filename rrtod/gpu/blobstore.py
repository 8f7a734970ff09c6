"""The GPU daemon's content-addressed weight cache on disk.

Persistent tensors (parameters, buffers) are named by a hash of their content, so a restarted app
offers the same names and uploads nothing the host already has. The name is
``rrtod.wire.content_hash`` (the app's client computes it too), BLAKE3-256: a robot
must not be able to make another robot's weights resolve to its own bytes, so the name has to be
collision-resistant (xxh3, used before, is not). BLAKE3 is the fastest such hash here
(``python -m bench.hashes``: ~0.3-0.7 ms/MB against ~1.2-1.4 for SHA-256 and ~2.6-3.4 for
BLAKE2b, on 2 shared cores).

Each blob is one file holding a serialized ``TensorData`` under ``root/<2 hex>/<62 hex>``, with
the identities allowed to see it in ``<name>.owners`` beside it (JSON list). Unless the cache is
``shared``, an entry is visible only to the identities that uploaded it: another robot that
asks for it is told it is missing and uploads it too (which, verified against the name, makes it
an owner), so the cache never tells anyone what weights others run. Writes go to a temporary
file and are renamed into place, so a crash never leaves a half blob under a valid name. Every
read checks the content against the name; a file changed on disk is dropped and reported
missing. The cache is bounded: the least recently used blobs (file mtime, bumped on every read,
so the order survives restarts) are evicted when a put would exceed ``max_bytes``. Files of
older versions (16-byte xxh3 names) are removed at start.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import structlog
from google.protobuf.message import DecodeError

from rrto.v1 import ops_pb2
from rrtod.wire import HASH_BYTES, hash_of

OWNERS = ".owners"

log = structlog.get_logger("rrtod.blobs")


class BlobError(ValueError):
    """A blob that does not match its name, or one the cache cannot hold."""


class _Entry:
    __slots__ = ("size", "owners")

    def __init__(self, size: int, owners: set[str]):
        self.size = size
        self.owners = owners


class BlobStore:
    """``has``/``put``/``get`` by content hash for one identity; thread-safe (sessions run in
    worker threads). ``shared``: every identity sees every entry (``weight_cache.shared``)."""

    def __init__(self, root: Path, max_bytes: int, shared: bool = False):
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.shared = shared
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._bytes = 0
        self._scan()

    # -- index -------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name[2:]

    @staticmethod
    def _owners_path(path: Path) -> Path:
        return path.with_name(path.name + OWNERS)

    def _scan(self) -> None:
        """Rebuild the LRU index from the files a previous run left (oldest mtime first).
        Interrupted writes, blobs without an owners file and other versions' files go."""
        found: list[tuple[float, bytes, _Entry]] = []
        dropped = 0
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                if f.name.endswith(OWNERS):
                    if not f.with_name(f.name[:-len(OWNERS)]).exists():
                        f.unlink(missing_ok=True)
                    continue
                try:
                    key = bytes.fromhex(sub.name + f.name)
                except ValueError:
                    key = b""
                owners = self._read_owners(f) if len(key) == HASH_BYTES else None
                if f.name.startswith(".") or owners is None:  # never valid now
                    f.unlink(missing_ok=True)
                    self._owners_path(f).unlink(missing_ok=True)
                    dropped += not f.name.startswith(".")
                    continue
                try:
                    st = f.stat()
                except OSError:
                    continue
                found.append((st.st_mtime, key, _Entry(st.st_size, owners)))
        if dropped:
            log.info("weight cache: removed files of another version or without owners",
                     files=dropped, root=str(self.root))
        for _, key, entry in sorted(found, key=lambda t: t[0]):
            self._index[key] = entry
            self._bytes += entry.size
        self._evict(0)

    def _read_owners(self, path: Path) -> set[str] | None:
        try:
            owners = json.loads(self._owners_path(path).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(owners, list) or not all(isinstance(o, str) for o in owners):
            return None
        return set(owners)

    def _write_owners(self, path: Path, owners: set[str]) -> None:
        target = self._owners_path(path)
        self._write(target, json.dumps(sorted(owners)).encode())

    @staticmethod
    def _write(path: Path, payload: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _drop(self, key: bytes) -> None:
        """Forget ``key`` and remove its files; the lock is held."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
        path = self._path(key)
        path.unlink(missing_ok=True)
        self._owners_path(path).unlink(missing_ok=True)

    def _evict(self, incoming: int) -> None:
        while self._index and self._bytes + incoming > self.max_bytes:
            self._drop(next(iter(self._index)))

    def _visible(self, key: bytes, identity: str) -> bool:
        entry = self._index.get(key)
        return entry is not None and (self.shared or identity in entry.owners)

    # -- API ---------------------------------------------------------------------------------
    def has(self, key: bytes, identity: str) -> bool:
        """Whether ``identity`` may use the entry ``key`` (not verified: ``get`` does)."""
        with self._lock:
            return self._visible(key, identity)

    def missing(self, keys: list[bytes], identity: str) -> list[bytes]:
        with self._lock:
            return [k for k in keys if not self._visible(k, identity)]

    def put(self, key: bytes, tensor: ops_pb2.TensorData, identity: str) -> None:
        """Store ``tensor`` under ``key`` for ``identity`` after checking that ``key`` is its
        content hash: whoever sent the content may use the entry from now on.
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
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
                if identity not in entry.owners:
                    entry.owners.add(identity)
                    self._write_owners(path, entry.owners)
                return
            self._evict(len(payload))
            path.parent.mkdir(exist_ok=True)
            self._write_owners(path, {identity})  # before the blob: a blob never lacks one
            self._write(path, payload)
            self._index[key] = _Entry(len(payload), {identity})
            self._bytes += len(payload)

    def get(self, key: bytes, identity: str) -> ops_pb2.TensorData | None:
        """The tensor, verified against ``key``; None when ``identity`` may not see it, it is
        not cached, or its file no longer matches its name (then it is dropped, so the robot
        uploads it again)."""
        with self._lock:
            if not self._visible(key, identity):
                return None
            self._index.move_to_end(key)
            path = self._path(key)
            try:
                payload = path.read_bytes()
                now = time.time()
                os.utime(path, (now, now))
            except OSError:  # removed behind our back: forget it
                self._drop(key)
                return None
        tensor = ops_pb2.TensorData()
        try:
            tensor.ParseFromString(payload)
            valid = hash_of(tensor) == key
        except DecodeError:
            valid = False
        if not valid:  # changed on disk: never hand out wrong weights
            log.warning("weight cache: blob does not match its name, dropped", blob=key.hex(),
                        path=str(path))
            with self._lock:
                self._drop(key)
            return None
        return tensor

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"blobs": len(self._index), "bytes": self._bytes, "max_bytes": self.max_bytes}
