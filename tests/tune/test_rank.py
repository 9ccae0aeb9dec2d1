"""The ranking of `skyline tune` on a synthetic profile: kernel names -> families, the floors of
the shapes a workload runs, time lost = time - floor, most lost first."""

from __future__ import annotations

import pytest

from skyline.engine.cost import ModelCost
from skyline.tune import rank

COST = ModelCost(linear_params=1000, head_params=100, weight_bytes=2200,
                 kv_bytes_per_token=10, attn_flops_per_pair=4)


@pytest.mark.parametrize("name,family", [
    ("_gemv_kernel", "gemv"), ("paged_decode_kernel", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "linear"), ("nvjet_tst_128x64", "linear"),
    ("mkldnn::_linear_pointwise", "linear"), ("aten::_weight_int4pack_mm_for_cpu", "linear"),
    ("_rms_norm_kernel", "norm"), ("gemv_quant_kernel", "gemv_quant"),
    ("gemv_block_a8_kernel", "gemv_block"), ("gemv_block_kernel", "gemv_block"),
    ("quantize_x_q8_kernel", "gemv_block"), ("dequant_block_kernel", "block_dequant"),
    ("skyline_cpu::intdot_mm", "linear"), ("skyline_cpu::decode_layers", "cpu_decode"),
    ("skyline_cpu::decode_attention", "attention"),
    ("void at::native::elementwise_kernel<...>", "other")])
def test_kernel_names_map_to_families(name, family):
    assert rank.family_of(name) == family


def test_tuners_per_device():
    assert rank.tuner_of("gemv", "cuda") == "gemv" and rank.tuner_of("gemv", "cpu") is None
    assert rank.tuner_of("gemv_block", "cuda") == "gemv_block"
    assert rank.tuner_of("linear", "cpu") == "cpu_linear"
    # the CPU's one-call decode step runs the plan's products: the same tuner
    assert rank.tuner_of("cpu_decode", "cpu") == "cpu_linear"
    assert rank.tuner_of("cpu_decode", "cuda") is None
    assert rank.tuner_of("linear", "cuda") is None and rank.tuner_of("other", "cuda") is None


def test_phase_work_counts_weights_per_step_and_kv_per_sequence():
    w = rank.phase_work(COST, prompts=4, new_tokens=1, context=100, steps=10)
    assert w.matmul_bytes == 10 * 2200  # weights once a step, whatever the batch
    assert w.matmul_flops == 10 * (2 * 1000 * 4 + 2 * 100 * 4)
    assert w.attention_bytes == 10 * 4 * 101 * 10
    assert w.attention_flops == 10 * 4 * 4 * (100 + 1)
    # prefill: one step, causal pairs
    p = rank.phase_work(COST, prompts=1, new_tokens=8, context=0, steps=1)
    assert p.attention_flops == 4 * 8 * 9 / 2 and p.matmul_flops == 2 * 1000 * 8 + 2 * 100
    assert p.floor("matmul", peak_flops=1e3, bandwidth=1e3) == pytest.approx(16.2)
    assert p.floor("attention", peak_flops=1e3, bandwidth=1e9) == pytest.approx(0.144)


def test_rank_by_time_lost_with_floors_shared_by_time():
    # decode: 2 s of gemv and 1 s of cuBLAS share a 1 s matmul floor by their time; attention
    # takes 1.5 s against a 1 s floor; norm (0.5 s in each phase) has no floor
    work = {"decode": rank.PhaseWork(matmul_bytes=1e3, matmul_flops=0.0,
                                     attention_bytes=1e3, attention_flops=0.0)}
    phases = {"decode": rank.by_family([
        {"name": "_gemv_kernel", "s": 1.5}, {"name": "split_k_epilogue", "s": 0.5},
        {"name": "nvjet_tst", "s": 1.0}, {"name": "paged_decode_kernel", "s": 1.5},
        {"name": "_rms_norm_kernel", "s": 0.5}]),
        "prefill": rank.by_family([{"name": "_rms_norm_kernel", "s": 0.5}])}  # no work: no floor
    rows = rank.rank(phases, work, peak_flops=1.0, bandwidth=1e3, device_type="cuda")
    by = {r["family"]: r for r in rows}
    assert [r["family"] for r in rows] == ["gemv", "norm", "linear", "attention"]
    assert by["gemv"]["floor_s"] == pytest.approx(2 / 3)
    assert by["gemv"]["lost_s"] == pytest.approx(4 / 3)
    assert by["gemv"]["floor_fraction"] == pytest.approx(1 / 3) and by["gemv"]["tuner"] == "gemv"
    assert by["linear"]["floor_fraction"] == pytest.approx(1 / 3)
    assert by["attention"]["lost_s"] == pytest.approx(0.5)
    assert by["norm"]["floor_s"] == 0 and by["norm"]["s"] == 1.0 and by["norm"]["tuner"] is None
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert by["linear"]["share"] == pytest.approx(1.0 / 5.5)


def test_a_floor_above_the_time_is_capped():
    work = {"d": rank.PhaseWork(1e6, 0.0, 0.0, 0.0)}
    rows = rank.rank({"d": rank.by_family([{"name": "_gemv_kernel", "s": 1.0}])}, work,
                     1.0, 1.0, "cuda")
    assert rows[0]["floor_fraction"] == 1.0 and rows[0]["lost_s"] == 0.0
