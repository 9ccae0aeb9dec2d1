"""The offline floor (skyline/bench/floor.py): its arithmetic by hand, and the peaks measured."""

from __future__ import annotations

import pytest
import torch

from skyline.bench.floor import copy_bandwidth, matmul_peak, offline_floor
from skyline.engine.cost import ModelCost, model_cost


def test_floor_by_hand():
    cost = ModelCost(linear_params=10, head_params=5, weight_bytes=100, kv_bytes_per_token=2,
                     attn_flops_per_pair=4)
    f = offline_floor(cost, num_prompts=2, input_len=3, output_len=4, concurrency=2,
                      peak_flops=10.0, bandwidth=100.0)
    # prefill: Linears 2*10*6, the head for each first token 2*5*2, causal pairs 2 * (1+2+3)
    assert f["prefill_s"] == pytest.approx((120 + 20 + 4 * 12) / 10)
    # decode: 3 steps of 2 rows, each max(weights 100 B / 100 B/s, 2*15*2 FLOPs / 10 FLOP/s)
    assert f["decode_steps"] == 3 and f["decode_linear_s"] == pytest.approx(18.0)
    # keys read: tokens t = 1..3 of each prompt see 3 + t keys
    keys = sum(3 + t for _ in range(2) for t in range(1, 4))
    # attention: the larger of its K/V bytes (keys * 2 B / 100 B/s) and FLOPs (4 per key / 10)
    assert f["decode_attention_s"] == pytest.approx(max(keys * 2 / 100, keys * 4 / 10)) == 12.0
    assert f["sequential_s"] == pytest.approx(18.8 + 18.0 + 12.0)
    flops = 188 + 30 * 6 + 4 * keys
    assert f["overlapped_s"] == pytest.approx(max(flops / 10, (300 + keys * 2) / 100))
    assert f["overlapped_s"] <= f["sequential_s"]  # no schedule beats the overlapped floor
    assert f["sequential_tok_s"] == pytest.approx(8 / f["sequential_s"])


def test_fewer_at_a_time_means_more_steps_and_a_higher_floor():
    cost = ModelCost(1000, 100, 1_000_000, 8, 16)  # decode steps read more than they compute
    args = dict(num_prompts=100, input_len=50, output_len=20, peak_flops=1e9, bandwidth=1e9)
    wide = offline_floor(cost, concurrency=100, **args)
    narrow = offline_floor(cost, concurrency=10, **args)
    assert narrow["decode_steps"] == 10 * wide["decode_steps"]
    assert narrow["decode_linear_s"] > wide["decode_linear_s"]
    assert narrow["prefill_s"] == wide["prefill_s"]
    assert narrow["decode_attention_s"] == wide["decode_attention_s"]
    assert offline_floor(cost, concurrency=1000, **args)["concurrency"] == 100


@pytest.mark.parametrize("prompts,input_len,output_len", [(3, 7, 5), (11, 13, 3), (1, 1, 2)])
def test_compute_bound_floors_are_equal_not_rounded_apart(prompts, input_len, output_len):
    # every part bound by FLOPs: the overlapped floor is the sequential one (two sums of the
    # same terms in other orders), never an ulp above it
    cost = ModelCost(576 * 1536 * 91, 49152 * 576, 1, 1, 7.3)
    f = offline_floor(cost, num_prompts=prompts, input_len=input_len, output_len=output_len,
                      concurrency=3, peak_flops=3.1e11, bandwidth=1e30)
    assert f["overlapped_s"] == pytest.approx(f["sequential_s"])
    assert f["overlapped_s"] <= f["sequential_s"]


def test_peaks_are_measured_on_the_cpu():
    cpu = torch.device("cpu")
    assert 1e8 < matmul_peak(cpu) < 1e14
    assert 1e8 < copy_bandwidth(cpu) < 1e13


def test_host_read_is_the_fastest_buffer_thread_count_and_read(monkeypatch):
    """The host's read rate is the best of every buffer, thread count and way of reading: one
    buffer of a virtual machine's memory may read at half the rate of the next."""
    from skyline.bench import floor

    seen, times = [], iter([4.0, 3.0, 2.0, 5.0, 1.0, 6.0, 7.0, 8.0])
    monkeypatch.setattr(floor, "_usable_cpus", lambda: {0, 1, 2})
    monkeypatch.setattr(floor, "_huge_page_ones", lambda n: torch.ones(n))

    def timed(read, reps):
        seen.append((torch.get_num_threads(), read.__name__))
        return next(times)

    monkeypatch.setattr(floor, "_best_seconds", timed)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert floor.host_read_bandwidth(nbytes=64, buffers=2) == 64 / 1.0
        assert seen == [(1, "sum"), (1, "amax"), (3, "sum"), (3, "amax")] * 2
        assert torch.get_num_threads() == 1
        seen.clear()
        times = iter([2.0, 4.0])
        assert floor.host_read_bandwidth(threads=2, nbytes=64, buffers=1) == 32.0
        assert seen == [(2, "sum"), (2, "amax")]
    finally:
        torch.set_num_threads(prev)


def test_model_cost_of_a_shipped_config_on_the_meta_device():
    # Llama-3.1-8B: 32 layers of q/o 4096^2, k/v 4096 x 1024, MLP 3 x 4096 x 14336; head 128256 wide
    bf16 = model_cost("llama-3.1-8b", None, "auto")
    assert bf16.linear_params == 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert bf16.head_params == 128256 * 4096
    assert bf16.weight_bytes == 2 * (bf16.linear_params + bf16.head_params)
    assert bf16.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    fp8 = model_cost("llama-3.1-8b", "fp8", "fp8")
    # one byte a weight plus a float32 scale per output channel; the head stays bf16
    channels = 32 * (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)
    assert fp8.weight_bytes == fp8.linear_params + 4 * channels + 2 * fp8.head_params
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token // 2


def test_machine_info_names_the_cpu_features_kernels_choose_by(tmp_path, monkeypatch):
    """Two VMs with the same model name and torch ISA may differ in the features the CPU
    plan reads: a result's machine lists which of them it had."""
    from skyline.bench import offline

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Intel(R) Xeon(R) Processor\n"
                       "flags\t\t: fpu sse avx2 fma avx512f avx512_vnni amx_tile\n")
    monkeypatch.setattr(offline, "CPUINFO", str(cpuinfo))
    info = offline.machine_info("cpu")
    assert info["cpu"] == "Intel(R) Xeon(R) Processor"
    assert info["cpu_flags"] == ["avx2", "fma", "avx512f", "avx512_vnni"]
    cpuinfo.unlink()  # no /proc/cpuinfo (not Linux): none listed, no error
    assert offline.machine_info("cpu")["cpu_flags"] == []
