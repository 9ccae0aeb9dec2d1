"""KV beyond the device, end to end on the CPU (fp32, tiny random HF model): greedy tokens are
the same whether a prefix came from the device, host RAM, disk or recompute — with chunked
prefill, preemption and async scheduling — and disk faults cost recompute, never a token,
a block or the engine."""

from __future__ import annotations

import glob
import os
import threading

import pytest
import torch
from tiny_hf import prefix_prompts

from skyline import LLM, SamplingParams
from skyline.config import ConfigError
from skyline.worker.connector import disk as disk_mod

transformers = pytest.importorskip("transformers")

VOCAB = 320
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# A device cache of 48 blocks of 4 tokens: the prompts below do not all fit, so the second
# round finds their prefixes below the device.
SMALL = dict(device="cpu", dtype="float32", num_blocks=48, block_size=4, max_model_len=128)


@pytest.fixture(scope="module")
def model_path(tiny_llama):
    return tiny_llama(0.15)


@pytest.fixture(scope="module")
def prompts():
    return prefix_prompts(VOCAB, 10, 40, (10, 40))


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    llm = LLM(model_path, device="cpu", dtype="float32", enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def run(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def settled(llm: LLM) -> dict[str, float]:
    """The engine is idle: every block back in the pool, nothing in flight, tiers consistent."""
    assert not llm.engine.has_unfinished()
    sched = llm.engine.scheduler
    pool = sched.kv_manager.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert not sched.kv_loads.loading and not sched.kv_loads._held
    connector = sched.kv_loads.connector
    if connector is not None:
        connector.check_invariants()
        assert connector.num_in_flight == 0
    return llm.engine.stats()


@pytest.mark.parametrize("mode", [
    dict(),
    dict(max_num_batched_tokens=5),  # chunked prefill mixed with decodes
    dict(async_scheduling="on"),
    dict(num_blocks=32, max_num_seqs=8, schedule_conservativeness=0),  # preemption
])
def test_same_tokens_from_ram(model_path, prompts, reference, mode):
    llm = LLM(model_path, **(SMALL | mode), kv_offload_ram="1MiB")
    assert run(llm, prompts) == reference
    assert run(llm, prompts) == reference
    s = settled(llm)
    assert s["kv_offload_ram_hit_tokens"] > 0 and s["kv_offload_ram_stored_blocks"] > 0
    if "num_blocks" in mode:
        assert s["num_preemptions"] > 0
    llm.engine.shutdown()


@pytest.mark.parametrize("policy", ["eviction", "eager"])
def test_same_tokens_from_disk_after_a_restart(model_path, prompts, reference, tmp_path,
                                               policy):
    disk = dict(kv_offload_disk=str(tmp_path), kv_offload_policy=policy)
    first = LLM(model_path, **SMALL, **disk)
    assert run(first, prompts) == reference
    assert run(first, prompts) == reference  # the second round fills the disk, by eviction
    settled(first)
    first.engine.shutdown()  # writes in flight end here
    assert glob.glob(f"{tmp_path}/*/*/*.kv")
    again = LLM(model_path, **SMALL, **disk, async_scheduling="on")
    assert run(again, prompts) == reference
    s = settled(again)
    assert s["kv_offload_disk_hit_tokens"] > 0, s
    again.engine.shutdown()


def test_damaged_files_cost_recompute_only(model_path, prompts, reference, tmp_path):
    disk = dict(kv_offload_disk=str(tmp_path), kv_offload_policy="eager")
    llm = LLM(model_path, **SMALL, **disk)
    run(llm, prompts)
    llm.engine.shutdown()
    llm = LLM(model_path, **SMALL, **disk)  # indexes every file, then they are damaged
    files = sorted(glob.glob(f"{tmp_path}/*/*/*.kv"))
    for i, path in enumerate(files):
        if i % 3 == 0:
            os.unlink(path)
        elif i % 3 == 1:
            with open(path, "r+b") as f:
                f.truncate(100)
        else:
            with open(path, "r+b") as f:
                f.seek(-3, os.SEEK_END)
                f.write(b"\x00\x01\x02")
    assert run(llm, prompts) == reference
    s = settled(llm)
    assert s["kv_offload_load_failed_blocks"] > 0
    assert run(llm, prompts) == reference  # written again; found this time
    llm.engine.shutdown()


def test_full_disk_and_read_only_directory(model_path, prompts, reference, tmp_path,
                                           monkeypatch):
    # a cap of a few blocks: the disk tier evicts to stay within it
    tiny = LLM(model_path, **SMALL, kv_offload_disk=str(tmp_path), kv_offload_policy="eager",
               kv_offload_disk_size="40KiB")
    assert run(tiny, prompts) == reference and run(tiny, prompts) == reference
    s = settled(tiny)
    assert 0 < s["kv_offload_disk_blocks"] <= s["kv_offload_disk_capacity_blocks"] < 40
    tiny.engine.shutdown()

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # the file system fills up
        m.setattr(disk_mod.os, "replace", no_space)
        full = LLM(model_path, **SMALL, kv_offload_disk=str(tmp_path / "full"),
                   kv_offload_policy="eager")
        assert run(full, prompts) == reference and run(full, prompts) == reference
        s = settled(full)
        assert s["kv_offload_store_failed_blocks"] > 0 and s["kv_offload_disk_blocks"] == 0
        full.engine.shutdown()

    def read_only(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise PermissionError(30, "Read-only file system")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk_mod, "open", read_only, raising=False)
    ro = LLM(model_path, **SMALL, kv_offload_disk=str(tmp_path))  # the files of `tiny`
    assert run(ro, prompts) == reference
    s = settled(ro)
    assert s["kv_offload_disk_hit_tokens"] > 0 and s["kv_offload_disk_stored_blocks"] == 0
    ro.engine.shutdown()


def test_two_engines_share_a_directory(model_path, prompts, reference, tmp_path):
    disk = dict(kv_offload_disk=str(tmp_path), kv_offload_policy="eager",
                kv_offload_disk_size="200KiB")
    a, b = LLM(model_path, **SMALL, **disk), LLM(model_path, **SMALL, **disk)
    half = len(prompts) // 2
    for llm in (a, b):
        for p in prompts:
            llm.add_request(p, GREEDY)
    done: dict[int, dict[str, list[int]]] = {0: {}, 1: {}}
    while a.engine.has_unfinished() or b.engine.has_unfinished():
        for i, llm in enumerate((a, b)):  # interleaved steps: both write, both evict
            for o in llm.step():
                if o.finished:
                    done[i][o.request_id] = o.outputs[0].token_ids
    for i in (0, 1):
        assert [done[i][str(j)] for j in range(len(prompts))] == reference
    assert run(a, prompts[half:]) == reference[half:]
    for llm in (a, b):
        settled(llm)
        llm.engine.shutdown()


def test_abort_while_loading_frees_blocks_when_the_load_ends(model_path, prompts, reference,
                                                              tmp_path, monkeypatch):
    disk = dict(kv_offload_disk=str(tmp_path), kv_offload_policy="eager")
    llm = LLM(model_path, **SMALL, **disk)
    run(llm, prompts)
    llm.engine.shutdown()
    llm = LLM(model_path, **SMALL, **disk)
    gate = threading.Event()  # disk reads wait for it: the loads stay in flight
    read = disk_mod.DiskStore.read
    monkeypatch.setattr(disk_mod.DiskStore, "read",
                        lambda self, k, out: gate.wait(10) and read(self, k, out))
    for p in prompts:
        llm.add_request(p, GREEDY)
    for _ in range(3):
        llm.step()  # admission: the requests wait for their KV from disk
    loads = llm.engine.scheduler.kv_loads
    loading = [r.request_id for r in loads.loading.values()]
    assert loading and not llm.engine.scheduler.running
    llm.abort(loading[0])
    assert loads._held and loads.holds(loading[0])  # its blocks are still being written
    gate.set()
    while llm.engine.has_unfinished():
        llm.step()
    settled(llm)
    assert run(llm, prompts) == reference
    llm.engine.shutdown()


@pytest.mark.parametrize("code", ["fp8", "int8"])
def test_compressed_tiers(model_path, prompts, reference, code):
    llm = LLM(model_path, **SMALL, kv_offload_ram="1MiB", kv_offload_dtype=code)
    assert run(llm, prompts) == reference  # the first round computes everything
    again = run(llm, prompts)
    s = settled(llm)
    assert s["kv_offload_ram_hit_tokens"] > 0
    # lossy: most greedy tokens survive one rounding of the restored KV
    same = sum(x == y for a, b in zip(again, reference, strict=True)
               for x, y in zip(a, b, strict=True))
    assert same >= 0.8 * sum(map(len, reference)), (again, reference)
    llm.engine.shutdown()


def test_bad_flags(model_path, tmp_path):
    (tmp_path / "f").write_text("x")
    bad = [
        (dict(kv_offload_disk=str(tmp_path / "f")), "is a file"),
        (dict(kv_offload_disk_size="1GiB"), "needs --kv-offload-disk"),
        (dict(kv_offload_ram="10"), "holds no block"),
        (dict(kv_offload_ram="1MiB", kv_offload_policy="lazy"), "eviction or eager"),
        (dict(kv_offload_ram="1MiB", kv_offload_dtype="fp8", kv_cache_dtype="fp8"),
         "moved as they are"),
        (dict(kv_offload_ram="1MiB", enable_prefix_caching=False), "prefix hashes"),
        (dict(kv_offload_ram="lots"), "cannot read"),
    ]
    for kw, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            LLM(model_path, **SMALL, **kw)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_cuda_tiers_same_tokens(model_path, prompts, tmp_path, kv):
    """On the GPU (copy streams, pinned RAM, CUDA graphs, async scheduling): the tokens of a
    prefix restored from RAM, then from disk after a restart, are those of the cold run."""
    gpu = SMALL | dict(device="cuda", num_blocks=64, kv_cache_dtype=kv)
    disk = dict(kv_offload_disk=str(tmp_path), kv_offload_policy="eager")
    llm = LLM(model_path, **gpu, **disk, kv_offload_ram="4MiB")
    cold = run(llm, prompts)
    assert run(llm, prompts) == cold
    s = settled(llm)
    assert s["kv_offload_ram_hit_tokens"] > 0 and s["kv_offload_disk_stored_blocks"] > 0
    llm.engine.shutdown()
    again = LLM(model_path, **gpu, **disk)
    assert run(again, prompts) == cold
    assert settled(again)["kv_offload_disk_hit_tokens"] > 0
    again.engine.shutdown()
