"""The disk tier: one file per block (and rank) in a directory that outlives the engine.

Layout: DIR/<fingerprint>/<first two hex digits of the key>/<key hex>.kv, where the fingerprint
names the model, dtypes, block size and parallel layout (worker/connector/fingerprint.py), so an
engine never reads another's blocks. A file is a fixed header (magic, payload size, CRC-32 of
the payload, the key, the fingerprint) and the payload. It is written to a temporary name and
renamed into place, so readers — this engine, a replica sharing the directory, a restarted
server — see a whole file or none; a reader checks every header field and the checksum.

Faults never reach the tokens: a missing, truncated or corrupt file is a failed read (the
block is recomputed; a damaged file is deleted), a full disk or a read-only directory a failed
write. Each kind of fault is logged once per store.

Reads and writes are blocking calls made on the connector's I/O threads; the payload moves
through a memoryview of host memory (a pinned slot), never through a Python bytes copy.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterator

log = logging.getLogger(__name__)

MAGIC = b"SKYKV\x00\x00\x01"
HEADER = struct.Struct("<8sQI32s16s")  # magic, payload bytes, crc32, key, fingerprint
SUFFIX = ".kv"
# Temporary files older than this are a crashed writer's: removed at start-up. (A live writer
# renames its file within seconds.)
STALE_TMP_S = 3600.0


class DiskStore:
    """Block files of one fingerprint under `root`; `payload_bytes` per block."""

    def __init__(self, root: str, fingerprint: bytes, payload_bytes: int) -> None:
        assert len(fingerprint) == 16
        self.fingerprint = fingerprint
        self.payload_bytes = payload_bytes
        self.dir = os.path.join(root, fingerprint.hex())
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self.writable = self._prepare()

    @property
    def file_bytes(self) -> int:
        return HEADER.size + self.payload_bytes

    def warn_once(self, kind: str, msg: str, *args: object) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning("KV disk tier: " + msg, *args)

    def _prepare(self) -> bool:
        """Create the directory; whether this engine may write into it."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, f".probe-{os.getpid()}-{threading.get_ident()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
            return True
        except OSError as e:
            if not os.path.isdir(self.dir):
                self.warn_once("dir", "cannot use %s (%s): no blocks are kept on disk",
                               self.dir, e.strerror or e)
            else:
                self.warn_once("read-only", "%s is read-only (%s): blocks already there are "
                               "read, none are written", self.dir, e.strerror or e)
            return False

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.dir, h[:2], h + SUFFIX)

    def free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.dir).free
        except OSError:
            return 0

    # ---------------------------------------------------------------- inventory

    def found(self) -> list[bytes]:
        """Keys of the whole block files here, oldest first (by modification time); removes
        files of the wrong size and a crashed writer's temporary files."""
        now = time.time()
        entries: list[tuple[float, bytes]] = []
        for path, st in self._walk():
            name = os.path.basename(path)
            if not name.endswith(SUFFIX):
                if ".tmp" in name and now - st.st_mtime > STALE_TMP_S and self.writable:
                    _unlink(path)
                continue
            try:
                key = bytes.fromhex(name[: -len(SUFFIX)])
            except ValueError:
                continue
            if len(key) != 32:
                continue
            if st.st_size == self.file_bytes:
                entries.append((st.st_mtime, key))
            elif self.writable:  # a damaged file (whole files are renamed into place)
                _unlink(path)
        entries.sort()
        return [k for _, k in entries]

    def _walk(self) -> Iterator[tuple[str, os.stat_result]]:
        try:
            subdirs = list(os.scandir(self.dir))
        except OSError:
            return
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                for e in os.scandir(sub.path):
                    if e.is_file(follow_symlinks=False):
                        yield e.path, e.stat(follow_symlinks=False)
            except OSError:
                continue

    # ---------------------------------------------------------------- blocks

    def read(self, key: bytes, out: memoryview) -> bool:
        """Read the block `key` into `out` (payload_bytes); False if it is missing or damaged
        (a damaged file is deleted)."""
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(HEADER.size)
                n = f.readinto(out) if len(head) == HEADER.size else 0
                extra = f.read(1) if n == self.payload_bytes else b""
        except FileNotFoundError:
            self.warn_once("missing", "a block file is missing (%s: an engine sharing the "
                           "directory may have evicted it); its tokens are recomputed", path)
            return False
        except OSError as e:
            self.warn_once("read", "cannot read %s (%s); its tokens are recomputed", path,
                           e.strerror or e)
            return False
        if len(head) != HEADER.size or n != self.payload_bytes or extra:
            self.warn_once("truncated", "%s has the wrong size (truncated?): deleted, its "
                           "tokens are recomputed", path)
            self._remove(path)
            return False
        magic, size, crc, file_key, fp = HEADER.unpack(head)
        if (magic, size, file_key, fp) != (MAGIC, self.payload_bytes, key, self.fingerprint) \
                or zlib.crc32(out) != crc:
            self.warn_once("corrupt", "%s fails its checksum or header: deleted, its tokens "
                           "are recomputed", path)
            self._remove(path)
            return False
        return True

    def write(self, key: bytes, payload: memoryview) -> bool:
        """Write the block `key` from `payload`; False if the disk is full or not writable."""
        if not self.writable:
            return False
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
        head = HEADER.pack(MAGIC, self.payload_bytes, zlib.crc32(payload), key,
                           self.fingerprint)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb", buffering=0) as f:
                f.write(head)
                f.write(payload)
            os.replace(tmp, path)  # atomic: readers see the old file, the new one, or none
            return True
        except OSError as e:
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.warn_once("full", "the disk holding %s is full: the tier holds no more "
                               "than it has now", self.dir)
            elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.writable = False
                self.warn_once("read-only", "%s became read-only (%s): no more blocks are "
                               "written", self.dir, e.strerror or e)
            else:
                self.warn_once("write", "cannot write %s (%s)", path, e.strerror or e)
            return False

    def delete(self, key: bytes) -> None:
        if self.writable:
            _unlink(self.path(key))

    def _remove(self, path: str) -> None:
        if self.writable:
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
