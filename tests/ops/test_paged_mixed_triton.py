"""The mixed-step attention (ops/attention.paged_mixed_attention: the decode kernel reading its
rows through query_start_loc, the prefill kernel over a flattened grid of query tiles) against
the PyTorch reference: decodes and extends in one launch in any order, one-token extends,
padding sequences of no queries and padding tokens of no sequence, KV splits, an fp8 cache, a
sliding window with sinks. Runs on CUDA, or in Triton's interpreter on CPU (small shapes)."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")

from paged_tables import shuffled_table  # noqa: E402

from skyline.ops.attention import (  # noqa: E402
    paged_attention,
    paged_attention_ref,
    paged_mixed_attention,
    paged_prefill_attention,
)
from skyline.ops.kv_quant import FP8_DTYPE, quantize_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PREFILL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}


def _step(shapes: list[tuple[int, int]], num_seqs: int, num_tokens: int, page: int,
          kvh: int, head_dim: int, seed: int, fp8: bool = False):
    """A step of sequences (q_len, seq_len), padded to num_seqs sequences (no queries, one
    token of context on block 0) and num_tokens tokens (random queries no sequence owns):
    (q, cache, qsl list, seq_lens list, table, scales)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seq_lens = [s for _, s in shapes]
    num_blocks = sum(-(-n // page) for n in seq_lens) + 2
    kv = torch.randn(2, num_blocks, page, kvh, head_dim, generator=g)
    scales = (1.0, 1.0)
    if fp8:
        scales = (0.03, 0.005)
        cache = torch.stack([quantize_kv(kv[0] * 4, FP8_DTYPE, scales[0]),
                             quantize_kv(kv[1] * 0.5, FP8_DTYPE, scales[1])])
    else:
        cache = kv
    cache[:, 0] = float("nan")  # table padding points here; the kernels must never read it
    table = shuffled_table(seq_lens, page, num_blocks, rng)
    # padding sequences' tables point at block 0: the kernels must not read them either
    table = torch.cat([table, table.new_zeros(num_seqs - len(shapes), table.shape[1])])
    qsl = [0]
    for q_len, _ in shapes:
        qsl.append(qsl[-1] + q_len)
    assert qsl[-1] <= num_tokens
    q = torch.randn(num_tokens, kvh * 2, head_dim, generator=g)
    return q, cache, qsl, seq_lens, table, scales


def _run(q, cache, qsl, seq_lens, table, scale, num_seqs, k_scale=1.0, v_scale=1.0,
         **kw) -> torch.Tensor:
    pad = num_seqs - len(seq_lens)
    qsl_t = torch.tensor(qsl + [qsl[-1]] * pad, dtype=torch.int32, device=DEV)
    lens_t = torch.tensor(seq_lens + [1] * pad, dtype=torch.int32, device=DEV)
    out = paged_mixed_attention(q.to(DEV), cache.to(DEV), qsl_t, lens_t, table.to(DEV), scale,
                                k_scale, v_scale, **kw)
    return out[: qsl[-1]].cpu()


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err.item()


@pytest.mark.parametrize("page", [4, 16])
def test_mixed_step_matches_reference(page):
    # (q_len, seq_len): extends between decodes, a one-token extend, a fresh prompt longer than
    # a tile, a chunk over a cached prefix; two padding sequences and 7 padding tokens
    shapes = [(1, 9), (20, 20), (1, 33), (1, 1), (37, 60), (1, 17), (5, 5)]
    num_seqs, num_tokens = 9, sum(q for q, _ in shapes) + 7
    q, cache, qsl, seq_lens, table, _ = _step(shapes, num_seqs, num_tokens, page, 2, 16, page)
    scale = 16**-0.5
    out = _run(q, cache, qsl, seq_lens, table, scale, num_seqs, prefill_cfg=PREFILL)
    n = qsl[-1]
    ref = paged_attention_ref(q[:n].double(), cache.double(), qsl, seq_lens, table, scale)
    _check(out, ref)


def test_mixed_extends_equal_the_prefill_kernel():
    """The flattened grid runs the per-sequence kernel's program: the same numbers, bit for
    bit, under the same launch configuration; and the decode rows equal a decode launch's."""
    shapes = [(1, 40), (1, 7), (24, 50), (3, 3), (19, 19)]
    num_seqs, num_tokens = 6, 64
    q, cache, qsl, seq_lens, table, _ = _step(shapes, num_seqs, num_tokens, 4, 2, 16, 3)
    scale = 0.3
    out = _run(q, cache, qsl, seq_lens, table, scale, num_seqs, prefill_cfg=PREFILL,
               decode_cfg={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "NUM_SPLITS": 1})
    n = qsl[-1]
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    eager = paged_attention(q[:n], cache, qsl, seq_lens, table, scale, num_decodes=2,
                            seq_lens_tensor=lens_t,
                            query_start_loc_tensor=torch.tensor(qsl, dtype=torch.int32))
    ext = paged_prefill_attention(q[2:n], cache, torch.tensor(qsl[2:], dtype=torch.int32) - 2,
                                  lens_t[2:], table[2:], scale, 24, config=PREFILL)
    assert torch.equal(out[2:], ext)
    ref = paged_attention_ref(q[:n].double(), cache.double(), qsl, seq_lens, table, scale)
    _check(out, ref)
    _check(eager, ref)


def test_mixed_split_decodes_fp8_cache():
    """KV splits (the combine kernel writes the decode rows through query_start_loc) over an
    fp8 cache holding K / k_scale and V / v_scale."""
    shapes = [(6, 30), (1, 45), (1, 12), (17, 17), (1, 70)]
    num_seqs, num_tokens = 8, 32
    q, cache, qsl, seq_lens, table, (ks, vs) = _step(shapes, num_seqs, num_tokens, 16, 2, 16,
                                                     5, fp8=True)
    scale = 16**-0.5
    out = _run(q, cache, qsl, seq_lens, table, scale, num_seqs, ks, vs, prefill_cfg=PREFILL,
               decode_cfg={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "NUM_SPLITS": 3})
    n = qsl[-1]
    ref = paged_attention_ref(q[:n].double(), cache.float().double(), qsl, seq_lens, table,
                              scale, k_scale=ks, v_scale=vs)
    _check(out, ref)


@pytest.mark.parametrize("splits", [1, 2])
def test_mixed_window_and_sinks(splits):
    shapes = [(1, 50), (30, 41), (1, 9), (12, 70)]
    num_seqs, num_tokens = 5, 48
    q, cache, qsl, seq_lens, table, _ = _step(shapes, num_seqs, num_tokens, 4, 2, 16, 7)
    scale = 0.25
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = _run(q, cache, qsl, seq_lens, table, scale, num_seqs, prefill_cfg=PREFILL,
               decode_cfg={"BLOCK_N": 16, "num_warps": 4, "num_stages": 2,
                           "NUM_SPLITS": splits},
               window=13, sinks=sinks.to(DEV))
    n = qsl[-1]
    ref = paged_attention_ref(q[:n].double(), cache.double(), qsl, seq_lens, table, scale,
                              window=13, sinks=sinks)
    _check(out, ref)


def test_mixed_programs_run_tiles_in_turn(monkeypatch):
    """More extends than the grid has programs beyond one per BLOCK_M tokens (verifications
    of a few drafts each, beside decodes): programs run several tiles, last first."""
    from skyline.ops import attention

    monkeypatch.setattr(attention, "MIXED_EXTENDS", 1)
    rng = random.Random(11)
    shapes = [(1, rng.randint(5, 40)) if i % 3 == 0 else (k := rng.randint(2, 4), k + 20)
              for i in range(14)] + [(30, 45)]
    num_seqs, num_tokens = 16, sum(q for q, _ in shapes) + 3
    q, cache, qsl, seq_lens, table, _ = _step(shapes, num_seqs, num_tokens, 4, 2, 16, 11)
    out = _run(q, cache, qsl, seq_lens, table, 0.25, num_seqs, prefill_cfg=PREFILL)
    n = qsl[-1]
    _check(out, paged_attention_ref(q[:n].double(), cache.double(), qsl, seq_lens, table, 0.25))


def test_mixed_more_sequences_than_tokens():
    """A graph of more sequences than tokens (max_num_seqs beside a small token count): the
    launches cover the first num_tokens sequences, which hold every one with tokens."""
    shapes = [(1, 9), (3, 12), (1, 5)]
    q, cache, qsl, seq_lens, table, _ = _step(shapes, 32, 8, 4, 2, 16, 13)
    out = _run(q, cache, qsl, seq_lens, table, 0.25, 32, prefill_cfg=PREFILL)
    n = qsl[-1]
    _check(out, paged_attention_ref(q[:n].double(), cache.double(), qsl, seq_lens, table, 0.25))


def test_mixed_padding_only():
    """A step whose every sequence is padding (as a graph's capture may be): nothing written,
    nothing read, no fault."""
    q, cache, _, _, table, _ = _step([(1, 3)], 4, 16, 4, 2, 16, 9)
    qsl_t = torch.zeros(5, dtype=torch.int32, device=DEV)
    lens_t = torch.ones(4, dtype=torch.int32, device=DEV)
    table = torch.zeros(4, table.shape[1], dtype=torch.int32)
    out = paged_mixed_attention(q.to(DEV), cache.to(DEV), qsl_t, lens_t, table.to(DEV), 0.25,
                                prefill_cfg=PREFILL)
    assert out.shape == q.shape


COMPILE = """
from skyline.bench.ptx import compile_for_sm90
from skyline.ops import attention_prefill_triton as P, attention_triton as K
ptr = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", sinks_ptr="*fp32",
           block_tables_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32")
i32 = "scale v_scale window num_seqs num_heads num_splits stride_qb stride_qh stride_qt stride_kb \
stride_ks stride_kh stride_bt stride_ob stride_oh stride_ot".split()
sig = ptr | dict.fromkeys(i32, "i32") | dict(scale="fp32", v_scale="fp32",
                                             part_ml_ptr="*fp32", part_acc_ptr="*fp32")
common = dict(HEAD_DIM=128, D_PAD=128, PAGE=16, BLOCK_N=64, IEEE=False, PIPELINE=True,
              NUM_STAGES=3, F16=False, PDL=True, FP8_WORDS=0, SINKS=False)
for kernel, const in (
        (K.paged_decode_kernel, dict(GROUP=4, GROUP_PAD=16, SPLIT=True, VARLEN=True)),
        (P.paged_prefill_varlen_kernel, dict(GROUP=4, BLOCK_M=64, S_PAD=256, PACK=1,
                                             PACK_PAD=1))):
    args = {n: sig[n] for n in kernel.arg_names if n in sig}
    compile_for_sm90(kernel, args, common | const, [n for n in args if n.endswith("_ptr")], 4, 3)
print("compiled")
"""


def test_mixed_kernels_compile_for_sm90():
    """The compiled path (early exits, the flattened grid's sequence search, the pipelined
    loops), which the interpreter does not take: both kernels compile for sm_90 without a
    GPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
