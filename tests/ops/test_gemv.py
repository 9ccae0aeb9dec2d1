"""The Triton small-batch GEMV against its PyTorch reference over a sweep of shapes, launch
configurations (FMA and tensor-core modes, split-K on and off), rows 1..8, bias, dtypes; and the
dispatcher. Runs on CUDA, or in Triton's interpreter on CPU (small shapes; fp32 and fp16 there,
as the interpreter's bf16 dot is not exact)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from skyline.ops.gemv import (  # noqa: E402
    MAX_ROWS,
    _split_counters,
    default_config,
    gemv,
    gemv_config,
    gemv_or_linear,
    gemv_ref,
    row_bucket,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def config(block_n: int, block_k: int, split_k: int, use_dot: bool, stages: int = 2) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "USE_DOT": use_dot,
            "num_warps": 4, "num_stages": stages}


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return x.to(DEV, dtype), w.to(DEV, dtype), b.to(DEV, dtype)


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    rtol, atol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 33, 200), (8, 64, 256), (5, 16, 40)])
def test_gemv_matches_reference(dtype, use_dot, split_k, bias, m, n, k):
    x, w, b = operands(m, n, k, dtype, seed=m * n + k)
    b = b if bias else None
    out = gemv(x, w, b, config=config(16, 32, split_k, use_dot))
    check(out, gemv_ref(x, w, b))


@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 33, 192), (8, 64, 288), (5, 16, 40)])
def test_prefetch_uses_each_tile_once_in_order(use_dot, split_k, m, n, k):
    # PREFETCH loads the next W tile before using the current one. W's rows end in NaN
    # columns (a wider buffer): a tile used one step off would bring them into the sums. K = 40
    # is not a multiple of the tiles (no prefetch there: the masked path).
    x, w, b = operands(m, n, k, torch.float32, seed=m + n + k)
    wide = torch.full((n, k + 64), float("nan"), device=DEV)
    wide[:, :k] = w
    cfg = {**config(16, 32, split_k, use_dot, stages=1), "PREFETCH": True}
    check(gemv(x, wide[:, :k], b, config=cfg), gemv_ref(x, w, b))


@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("use_dot", [False, True])
def test_every_row_count(m, use_dot):
    x, w, b = operands(m, 48, 128, torch.float32, seed=m)
    out = gemv(x, w, b, config=config(16, 64, 2, use_dot))
    check(out, gemv_ref(x, w, b))


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_default_config(m):
    # No tuned table on CPU: the heuristic default runs, whatever it chooses.
    x, w, b = operands(m, 72, 2048, torch.float16, seed=m)
    check(gemv(x, w, b), gemv_ref(x, w, b))


def test_default_config_follows_the_tuned_winners():
    # One row: four output rows a program (FMA), 1,024-column tiles prefetched when N <= K,
    # 512 without prefetch when wider; few programs (a router): a pipelined K loop.
    deep, wide, router = (default_config(1, 4096, 14336), default_config(1, 6144, 4096),
                          default_config(1, 128, 2048))
    assert not deep["USE_DOT"] and deep["BLOCK_N"] == 4 and deep["SPLIT_K"] == 1
    assert (deep["BLOCK_K"], deep["PREFETCH"]) == (1024, True)
    assert wide["BLOCK_K"] == 512 and not wide.get("PREFETCH")
    assert router["num_stages"] > 1 and not router.get("PREFETCH")
    # Two rows: FMA while N <= K, tensor cores for wider products; more rows: tensor cores.
    assert not default_config(2, 4096, 12288)["USE_DOT"]
    assert default_config(2, 6144, 4096)["USE_DOT"] and default_config(8, 4096, 4096)["USE_DOT"]
    # Eight rows split K for few output rows, every split still looping over several K tiles.
    few, many = default_config(8, 4096, 4096), default_config(8, 128256, 4096)
    assert few["SPLIT_K"] > 1 and many["SPLIT_K"] == 1
    assert 4096 // few["SPLIT_K"] >= 4 * few["BLOCK_K"]


@pytest.mark.parametrize("m,n,k", [(1, 40, 2880), (1, 3000, 1024), (2, 24, 2048), (2, 96, 48)])
def test_default_config_shapes(m, n, k):
    # K not a multiple of the 1,024-column tile (the masked path, no prefetch), N > K, N <= K.
    x, w, b = operands(m, n, k, torch.float32, seed=n + k)
    check(gemv(x, w, b, config=default_config(m, n, k)), gemv_ref(x, w, b))


def test_split_k_leaves_its_counters_zeroed():
    # The last split of each tile resets the tile's arrival counter for the next launch.
    x, w, b = operands(3, 80, 256, torch.float32, seed=2)
    for split_k in (2, 4, 3):
        check(gemv(x, w, b, config=config(16, 32, split_k, False)), gemv_ref(x, w, b))
        assert _split_counters(x.device).count_nonzero().item() == 0


def test_row_bucket_and_cached_config():
    assert [row_bucket(m) for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    dev = torch.device(DEV)
    assert gemv_config(3, 4096, 4096, dev) is gemv_config(3, 4096, 4096, dev)
    assert gemv_config(3, 4096, 4096, dev) == gemv_config(4, 4096, 4096, dev)


def test_strided_operands_and_leading_dims():
    x, w, b = operands(6, 40, 160, torch.float32, seed=7)
    wide = torch.randn(40, 200, device=DEV)
    wide[:, :160] = w
    xs = torch.randn(6, 300, device=DEV)
    xs[:, 100:260] = x
    out = gemv(xs[:, 100:260], wide[:, :160], b, config=config(16, 32, 2, False))
    check(out, gemv_ref(x, w, b))
    out3 = gemv(x.view(2, 3, 160), w, b, config=config(32, 64, 1, True))
    check(out3, gemv_ref(x, w, b).view(2, 3, 40))


def test_bad_input_is_a_clear_error():
    x, w, b = operands(9, 16, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="1..8 rows"):
        gemv(x, w)
    with pytest.raises(ValueError, match="does not match"):
        gemv(x[:2], w[:, :16])
    with pytest.raises(ValueError, match="bias"):
        gemv(x[:2], w, b[:3])
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        gemv(x[:2], w[None])
    with pytest.raises(ValueError, match="USE_DOT"):
        gemv(x[:2], w, config=config(8, 32, 1, True))


def test_dispatcher_falls_back_to_linear():
    # Off CUDA, in fp32 or past MAX_ROWS rows the dispatcher is exactly F.linear.
    for m, dtype in [(1, torch.float32), (MAX_ROWS + 1, torch.float16)]:
        x, w, b = operands(m, 24, 64, dtype, seed=m)
        assert torch.equal(gemv_or_linear(x, w, b), F.linear(x, w, b))
    if DEV == "cpu":
        x, w, b = operands(2, 24, 64, torch.bfloat16, seed=3)
        assert torch.equal(gemv_or_linear(x, w, b), F.linear(x, w, b))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (1000, 3000)])
def test_model_shapes_on_cuda(dtype, m, n, k):
    x, w, b = operands(m, n, k, dtype, seed=m)
    ref = gemv_ref(x, w, b)
    check(gemv_or_linear(x, w, b), ref)
    for cfg in [config(4, 256, 1, False, 1), config(8, 128, 4, False, 3),
                config(64, 128, 2, True, 3), config(128, 64, 1, True, 4),
                config(64, 128, 8, True, 3)]:
        check(gemv(x, w, b, config=cfg), ref)


@cuda
def test_split_k_is_deterministic_on_cuda():
    # Whichever split finishes last, it adds the partial sums in split order.
    x, w, b = operands(2, 4096, 14336, torch.bfloat16, seed=5)
    outs = [gemv(x, w, b, config=config(16, 256, 8, False, 3)) for _ in range(5)]
    assert all(torch.equal(o, outs[0]) for o in outs)


@cuda
def test_cuda_graph_replay():
    x, w, b = operands(4, 4096, 4096, torch.bfloat16, seed=1)
    cfg = config(64, 128, 4, True, 3)  # split-K: two kernels and a scratch buffer per call
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv(static_x, w, b, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(static_x, w, b, config=cfg)
    for seed in range(3):
        new_x, _, _ = operands(4, 4096, 4096, torch.bfloat16, seed=10 + seed)
        static_x.copy_(new_x)
        graph.replay()
        check(out, gemv_ref(new_x, w, b))
