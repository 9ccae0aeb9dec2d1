"""The tiers' worker half (worker/connector/): block payloads, the disk store's faults, the
transfers on CPU tensors, and the merge of ranks' reports."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
import torch

from skyline.cache.prefix import hash_block
from skyline.types import KV_DROP, KV_LOAD, KV_SPILL, KV_STORE, KVTransfer, RunnerOutput
from skyline.worker.connector import disk as disk_mod
from skyline.worker.connector.base import ReportMerger, merge_info
from skyline.worker.connector.codec import BlockCodec
from skyline.worker.connector.disk import HEADER, DiskStore
from skyline.worker.connector.host import runs

FP = bytes(range(16))


def key(i: int) -> bytes:
    return hash_block(b"", [i])


def caches(dtype: torch.dtype, num_blocks: int = 6, layers: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, num_blocks, 4, 2, 16, generator=g) * 3).to(dtype)
            for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_codec_moves_blocks_exactly(dtype):
    src, dst = caches(dtype), [torch.zeros_like(c) for c in caches(dtype)]
    a, b = BlockCodec(src), BlockCodec(dst)
    payload = a.gather(torch.tensor([4, 1]))
    assert payload.shape == (2, a.payload_bytes) and payload.dtype == torch.uint8
    b.scatter(payload, torch.tensor([0, 5]))
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, 0].view(torch.uint8), s[:, 4].view(torch.uint8))
        assert torch.equal(d[:, 5].view(torch.uint8), s[:, 1].view(torch.uint8))
        assert not d[:, 1:5].view(torch.uint8).any()


@pytest.mark.parametrize("code,tol", [("fp8", 0.07), ("int8", 0.01)])
def test_compressed_payloads_halve_the_bytes_within_one_rounding(code, tol):
    src = caches(torch.bfloat16)
    dst = [torch.zeros_like(c) for c in src]
    a, b = BlockCodec(src, code), BlockCodec(dst, code)
    assert a.payload_bytes < 0.7 * BlockCodec(src).payload_bytes  # head_dim 16: 0.62
    b.scatter(a.gather(torch.tensor([2, 3])), torch.tensor([2, 3]))
    for s, d in zip(src, dst, strict=True):
        x, y = s[:, 2:4].float(), d[:, 2:4].float()
        # per (token, head) row: error relative to the row's largest value
        err = ((x - y).abs().amax(-1) / x.abs().amax(-1)).max()
        assert err < tol, err


def test_runs_coalesce_consecutive_slots():
    assert runs([3, 4, 5, 9, 2, 3]) == [(0, 3, 3), (3, 9, 1), (4, 2, 2)]
    assert runs([]) == []


# ---------------------------------------------------------------- disk


def payload(i: int, n: int = 64) -> memoryview:
    return memoryview(bytes((i + j) % 256 for j in range(n)))


def read(store: DiskStore, k: bytes) -> bytes | None:
    out = bytearray(store.payload_bytes)
    return bytes(out) if store.read(k, memoryview(out)) else None


def test_disk_round_trip_and_inventory_order(tmp_path):
    s = DiskStore(str(tmp_path), FP, 64)
    for i in (2, 0, 1):
        assert s.write(key(i), payload(i))
        os.utime(s.path(key(i)), (1000 + i, 1000 + i))
    assert read(s, key(1)) == bytes(payload(1))
    assert s.found() == [key(0), key(1), key(2)]  # oldest first
    other = DiskStore(str(tmp_path), bytes(16), 64)  # another model: its own directory
    assert other.found() == [] and read(other, key(1)) is None


def test_disk_faults_fail_the_read_warn_once_and_delete(tmp_path, caplog):
    s = DiskStore(str(tmp_path), FP, 64)
    for i in range(4):
        s.write(key(i), payload(i))
    with open(s.path(key(0)), "r+b") as f:  # a flipped payload byte
        f.seek(HEADER.size + 5)
        f.write(b"\xff")
    with open(s.path(key(1)), "r+b") as f:
        f.truncate(HEADER.size + 10)
    os.unlink(s.path(key(2)))
    with caplog.at_level(logging.WARNING):
        assert read(s, key(0)) is None and read(s, key(1)) is None
        assert read(s, key(2)) is None and read(s, key(2)) is None
    assert not os.path.exists(s.path(key(0))) and not os.path.exists(s.path(key(1)))
    assert read(s, key(3)) == bytes(payload(3))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings  # corrupt, truncated, missing: once each
    # a file of another block renamed into this one's place is caught by its header
    os.replace(s.path(key(3)), s.path(key(2)))
    assert read(s, key(2)) is None


def test_disk_full_and_read_only(tmp_path, monkeypatch, caplog):
    s = DiskStore(str(tmp_path), FP, 64)
    s.write(key(0), payload(0))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING):
        m.setattr(disk_mod.os, "replace", full)
        assert not s.write(key(1), payload(1))
        assert not s.write(key(2), payload(2))
    assert len(caplog.records) == 1 and "full" in caplog.records[0].getMessage()
    assert not [p for p in os.listdir(os.path.dirname(s.path(key(1)))) if ".tmp" in p]
    assert s.writable  # a full disk may drain: later writes are tried

    def denied(path, mode="r", *a, **k):
        if "w" in mode:
            raise PermissionError(errno.EROFS, "Read-only file system")
        return open(path, mode, *a, **k)

    monkeypatch.setattr(disk_mod, "open", denied, raising=False)
    ro = DiskStore(str(tmp_path), FP, 64)
    assert not ro.writable and ro.found() == [key(0)]
    assert read(ro, key(0)) == bytes(payload(0)) and not ro.write(key(5), payload(5))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_disk_read_only_directory(tmp_path):
    DiskStore(str(tmp_path), FP, 64).write(key(0), payload(0))
    os.chmod(tmp_path / FP.hex(), 0o555)
    try:
        ro = DiskStore(str(tmp_path), FP, 64)
        assert not ro.writable and read(ro, key(0)) == bytes(payload(0))
    finally:
        os.chmod(tmp_path / FP.hex(), 0o755)


def test_two_writers_of_one_directory_never_expose_a_partial_file(tmp_path):
    a, b = DiskStore(str(tmp_path), FP, 4096), DiskStore(str(tmp_path), FP, 4096)
    stop = threading.Event()
    bad = []

    def write(store: DiskStore) -> None:
        while not stop.is_set():
            for i in range(8):
                store.write(key(i), payload(i, 4096))

    def check() -> None:
        while not stop.is_set():
            for i in range(8):
                got = read(a, key(i))
                if got is not None and got != bytes(payload(i, 4096)):
                    bad.append(i)

    threads = [threading.Thread(target=write, args=(s,)) for s in (a, b)]
    threads.append(threading.Thread(target=check))
    for t in threads:
        t.start()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert not bad
    assert sorted(a.found()) == sorted(key(i) for i in range(8))


def test_stale_temporary_and_wrong_size_files_are_removed(tmp_path):
    s = DiskStore(str(tmp_path), FP, 64)
    s.write(key(0), payload(0))
    sub = os.path.dirname(s.path(key(0)))
    tmp = os.path.join(sub, "x.kv.1-2.tmp")
    open(tmp, "wb").close()
    os.utime(tmp, (0, 0))
    short = s.path(key(1))
    os.makedirs(os.path.dirname(short), exist_ok=True)
    with open(short, "wb") as f:
        f.write(b"x")
    assert s.found() == [key(0)]
    assert not os.path.exists(tmp) and not os.path.exists(short)


# ---------------------------------------------------------------- transfers


@pytest.fixture
def worker(tmp_path):
    from skyline.config import (
        CacheConfig,
        EngineConfig,
        ModelArch,
        ModelConfig,
        OffloadConfig,
        SchedulerConfig,
    )
    from skyline.worker.connector.tiers import TierWorker

    arch = ModelArch("LlamaForCausalLM", 32, 16, 32, 3, 2, 2, 16)
    cfg = EngineConfig(ModelConfig(str(tmp_path), "dummy", arch, "float32", 64),
                       CacheConfig(block_size=4), SchedulerConfig(max_model_len=64),
                       offload=OffloadConfig(ram_bytes=1 << 20, disk_dir=str(tmp_path / "d")))
    kv = caches(torch.float32)
    w = TierWorker(cfg, kv, [(1.0, 1.0)] * 3)
    yield w, kv
    w.shutdown()


def drain(w, n_ops: int) -> tuple[list[int], dict[int, list[int]]]:
    done, failed = [], {}
    deadline = time.monotonic() + 10
    while len(done) < n_ops and time.monotonic() < deadline:
        w.wait(0.01)
        d, f = w.poll()
        done += d
        failed |= f
    assert len(done) == n_ops
    return done, failed


def test_worker_store_spill_load_drop(worker):
    w, kv = worker
    before = [c.clone() for c in kv]
    keys = [key(i) for i in range(3)]
    w.start([KVTransfer(0, KV_STORE, keys, [0, 1, 2], [5, 6, 7], [True, False, False])])
    drain(w, 1)
    w.start([KVTransfer(1, KV_SPILL, keys[1:], [], [6, 7], [True, True])])
    drain(w, 1)
    for c in kv:
        c[:, :3] = 0
    # 0 from RAM, 1 and 2 from disk (2's file removed first: a failed read)
    os.unlink(w.disk.path(keys[2]))
    w.start([KVTransfer(2, KV_LOAD, keys, [3, 4, 5], [5, -1, -1], [False, True, True])])
    done, failed = drain(w, 1)
    assert failed == {2: [2]}
    for b, c in zip(before, kv, strict=True):
        assert torch.equal(c[:, 3:5], b[:, 0:2])
    w.start([KVTransfer(3, KV_DROP, keys[:2])])
    drain(w, 1)
    assert not os.path.exists(w.disk.path(keys[0])) and not os.path.exists(w.disk.path(keys[1]))
    assert w.num_in_flight == 0
    info = w.info()
    assert info["ram_slots"] == (1 << 20) // w.codec.payload_bytes and info["disk_writable"]


def test_merge_ranks():
    a = {"ram_slots": 4, "disk_blocks": 9, "disk_writable": True, "disk_found": [b"a", b"b"],
         "ram_is_buffer": False}
    b = {"ram_slots": 3, "disk_blocks": 10, "disk_writable": False, "disk_found": [b"b"],
         "ram_is_buffer": False}
    assert merge_info([a, b]) == {"ram_slots": 3, "disk_blocks": 9, "disk_writable": False,
                                  "disk_found": [b"b"], "ram_is_buffer": False}
    m = ReportMerger(2)
    out = RunnerOutput()
    m.merge([RunnerOutput(kv_finished=[1, 2], kv_failed={1: [0]}), RunnerOutput()], out)
    assert out.kv_finished == [] and out.kv_failed == {}
    m.merge([RunnerOutput(), RunnerOutput(kv_finished=[2, 1], kv_failed={1: [3]})], out)
    assert sorted(out.kv_finished) == [1, 2] and out.kv_failed == {1: [0, 3]}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_worker_transfers_on_cuda(tmp_path, dtype):
    """Stores gathered on the compute stream and copied out on a side stream, a block
    reallocated and overwritten by the next kernel at once, loads from pinned RAM and from
    disk: the bytes come back exactly."""
    from skyline.config import (
        CacheConfig,
        EngineConfig,
        ModelArch,
        ModelConfig,
        OffloadConfig,
        SchedulerConfig,
    )
    from skyline.worker.connector.tiers import TierWorker

    arch = ModelArch("LlamaForCausalLM", 32, 16, 32, 3, 2, 2, 16)
    cfg = EngineConfig(ModelConfig(str(tmp_path), "dummy", arch, "bfloat16", 64),
                       CacheConfig(block_size=4), SchedulerConfig(max_model_len=64),
                       device="cuda",
                       offload=OffloadConfig(ram_bytes=1 << 20, disk_dir=str(tmp_path / "d"),
                                             policy="eager"))
    kv = [c.cuda() for c in caches(dtype, num_blocks=64)]
    before = [c.clone() for c in kv]
    w = TierWorker(cfg, kv, [(1.0, 1.0)] * 3)
    keys = [key(i) for i in range(32)]
    w.start([KVTransfer(0, KV_STORE, keys, list(range(32)), list(range(32)), [True] * 32)])
    for c in kv:  # the next "step" overwrites the stored blocks at once
        c[:, :32].zero_()
    drain(w, 1)
    w.start([KVTransfer(1, KV_LOAD, keys[:16], list(range(32, 48)), list(range(16)),
                        [False] * 16),
             KVTransfer(2, KV_LOAD, keys[16:], list(range(48, 64)), [-1] * 16, [True] * 16)])
    drain(w, 2)
    torch.cuda.synchronize()
    for b, c in zip(before, kv, strict=True):
        assert torch.equal(c[:, 32:64].view(torch.uint8), b[:, :32].view(torch.uint8))
    w.shutdown()
