"""Small-batch GEMV: y = x W^T (+ b) for 1..8 rows of x, as in batch-1..8 decode.

At a handful of rows a linear layer is bound by reading W once; cuBLAS reaches only 0.3-0.6 of
copy bandwidth on the H200 for the 4k-row projections. The Triton kernel here streams W in
[BLOCK_N, BLOCK_K] tiles, reusing all rows of x per tile (fp32 accumulation), in one of two
modes:

- FMA: elementwise products into a [BLOCK_N, BLOCK_M, BLOCK_K] fp32 accumulator, reduced
  over K once at the end (no cross-lane reduction inside the loop);
- DOT: tensor cores with W as the left operand, y^T = W x^T, x padded to 16 rows.

With SPLIT_K > 1 the programs also split K (for matrices with few output rows, so that there
are enough programs to keep every SM streaming). Each split writes fp32 partial sums and counts
itself in on a per-tile counter; the last split of a tile to arrive adds all partials in split
order (deterministic, unlike float atomics), adds the bias, casts, stores y and resets the
counter. No second kernel: in a CUDA graph each extra launch costs about a microsecond, a
large share of a 4k x 4k projection's ~8 us. Launch configurations are data
(`skyline/ops/configs/`, written by `bench/kernels/tune_gemv.py`), with a heuristic default for
shapes that were not tuned.

CUDA-graph safe: the partials are a plain `torch.empty` per call, the counters one zeroed
buffer per device, allocated on first use outside capture (the runner warms the model up before
capturing; a launch captured before any split-K launch ran does not split) and left zeroed by
every launch, and nothing reads back to the host.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from skyline.ops.pdl import pdl_wait, use_pdl
from skyline.ops.triton_utils import interpreted, tl, triton
from skyline.ops.tuning import get_config

MAX_ROWS = 8  # the dispatcher uses the kernel for at most this many rows of x
MAX_SPLIT_TILES = 1 << 16  # output tiles (N / BLOCK_N) a split-K launch may have
KERNEL = "gemv"  # the kernel's name in the tuning tables
_DTYPES = (torch.bfloat16, torch.float16)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
             ) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] -> [..., N] in x's dtype (fp32 accumulation)."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def row_bucket(m: int) -> int:
    """The tuning bucket of m rows: the next power of two (1, 2, 4, 8)."""
    return 1 << max(0, m - 1).bit_length()


def config_key(m: int, n: int, k: int) -> str:
    """Tuning-table key of an [m, k] x [n, k]^T product (the same for bf16 and fp16)."""
    return f"{n}x{k}:m{row_bucket(m)}"


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """A launch configuration for shapes without a tuned entry.

    Drawn from the tuners' winners on the H100 and H200 (bench/results/kernels/gemv-tune-*):
    one row, and two rows of a product no wider than it is deep (N <= K), stream four output
    rows a program in FMA mode, 1,024 columns a tile when N <= K (then, at one row, the next
    tile prefetched into registers), 512 otherwise; products with fewer such programs than SMs
    (a router's few experts) pipeline their long K loop instead. Two rows of a wider product, and
    more rows, take tensor cores: 64-row tiles, K split until there are about four programs per
    SM while each split still loops over at least four K tiles.
    """
    if m == 1 or (m == 2 and n <= k):
        few = _cdiv(n, 4) < num_sms
        cfg = {"BLOCK_N": 4, "BLOCK_K": 1024 if n <= k else 512, "SPLIT_K": 1,
               "USE_DOT": False, "num_warps": 4, "num_stages": 3 if few else 1}
        return {**cfg, "PREFETCH": True} if m == 1 and n <= k and not few else cfg
    if m == 2:
        return {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "USE_DOT": True,
                "num_warps": 4, "num_stages": 5}
    block_n, block_k, split_k = 64, 128, 1
    while (_cdiv(n, block_n) * split_k < 4 * num_sms
           and k // (2 * split_k) >= 4 * block_k and split_k < 16):
        split_k *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "USE_DOT": True,
            "num_warps": 4, "num_stages": 3}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def gemv_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The tuned configuration for this shape on `device` if there is one, else default_config.
    Cached: a decode step looks it up for every layer."""
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 132)
    m = row_bucket(m)
    return get_config(KERNEL, config_key(m, n, k), default_config(m, n, k, num_sms))


def gemv_or_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """F.linear's contract; the Triton GEMV on CUDA for 1..MAX_ROWS rows of bf16/fp16."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if (triton is None or not x.is_cuda or not 1 <= m <= MAX_ROWS or x.dtype not in _DTYPES
            or weight.dtype != x.dtype or weight.dim() != 2 or weight.stride(1) != 1
            or (bias is not None and bias.dtype != x.dtype)):
        return F.linear(x, weight, bias)
    return gemv(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows in all), weight [N, K] with unit stride along K,
    bias [N] -> [..., N] in x's dtype. `config` overrides the tuned/default launch config."""
    if triton is None:
        raise RuntimeError("the Triton GEMV needs triton; install it or use gemv_ref")
    if weight.dim() != 2:
        raise ValueError(f"gemv: weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match a contiguous weight "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} does not match {n} output features")
    x2 = gemv_rows(x, k, "gemv")
    m = x2.shape[0]
    cfg = config if config is not None else gemv_config(m, n, k, x.device)
    block_n, block_k, split_k = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    use_dot = bool(cfg["USE_DOT"])
    if use_dot and min(block_n, block_k) < 16:
        raise ValueError(f"gemv config {cfg}: USE_DOT needs BLOCK_N and BLOCK_K >= 16")
    num_tiles = _cdiv(n, block_n)
    split_k, partial, counters = split_k_plan(x, split_k, num_tiles, m, n, f"gemv config {cfg}")
    block_m = 16 if use_dot else row_bucket(m)  # tensor-core operands have at least 16 rows
    k_iters = _cdiv(_cdiv(k, split_k), block_k)  # K tiles per split
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if partial is None:  # unused unless split
        partial, counters = y, y
    interp = interpreted()
    pdl = use_pdl(x.device)
    _gemv_kernel[(num_tiles, split_k)](
        x2, weight, bias if bias is not None else weight, y, partial, counters,
        m, n, k, k_iters, split_k, x2.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % (split_k * block_k) == 0, SPLIT=split_k > 1,
        USE_DOT=use_dot, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg["num_stages"],
        STATIC_ITERS=k_iters if interp else 0, PDL=pdl,
        PREFETCH=bool(cfg.get("PREFETCH", False)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )
    return y.reshape(*x.shape[:-1], n)


def gemv_rows(x: torch.Tensor, k: int, what: str, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """x [..., K] as the [M, K] rows a GEMV launch reads (unit stride along K), 1 <= M <=
    max_rows (a ValueError naming `what` otherwise)."""
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if not 1 <= x2.shape[0] <= max_rows:
        raise ValueError(f"{what} takes 1..{max_rows} rows, got {x2.shape[0]}; use F.linear")
    return x2


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_k_plan(x: torch.Tensor, split_k: int, num_tiles: int, m: int, n: int, what: str
                 ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(split_k, fp32 partials [split_k, m, n], counters) of a launch over num_tiles output
    tiles, shared by the GEMVs here and in gemv_quant.py / gemv_int_a8.py; (1, None, None)
    unsplit. A launch captured into a graph before the device's counters exist does not split:
    their zeroing would only be recorded into the graph, not run."""
    if (split_k > 1 and x.is_cuda and x.device not in _COUNTERS
            and torch.cuda.is_current_stream_capturing()):
        split_k = 1
    if split_k == 1:
        return 1, None, None
    if num_tiles > MAX_SPLIT_TILES:
        raise ValueError(f"{what}: split K needs at most {MAX_SPLIT_TILES} output tiles; raise "
                         "BLOCK_N or use SPLIT_K 1")
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    return split_k, partial, _split_counters(x.device)


def _split_counters(device: torch.device) -> torch.Tensor:
    """[MAX_SPLIT_TILES] int32 arrival counters, zero between launches (the last split of a tile
    resets its counter), allocated once per device so that a captured graph keeps using them.
    Launches that split K must not overlap in time (one stream, as a decode step runs)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32,
                                                   device=device)
    return counters


if triton is not None:

    @triton.jit
    def split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask,
                         m_mask, pid_n, pid_k, M, N, num_splits, HAS_BIAS: tl.constexpr,
                         SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        # out [BLOCK_N, BLOCK_M] fp32 (+ bias) -> y [M, N]; with SPLIT, through the partials
        # and the last-arriver reduction (shared by the quantized GEMVs of gemv_quant.py).
        y_mask = n_mask[:, None] & m_mask[None, :]
        y_offs = offs_m[None, :] * N + offs_n[:, None]  # y and each partial are [M, N]
        if SPLIT:
            tl.store(part_ptr + pid_k * M * N + y_offs, out, mask=y_mask)
            # Every thread's partial is written before the count goes up (barrier, then a
            # release at GPU scope); the last arrival acquires them all.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                # All partials (this one's too) in split order: the sum does not depend on
                # which split finished last. ".cg": read L2, where the other SMs' writes are.
                out = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                s = 0
                while s < num_splits:
                    out += tl.load(part_ptr + s * M * N + y_offs, mask=y_mask, other=0.0,
                                   cache_modifier=".cg")
                    s += 1
                if HAS_BIAS:
                    out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
                tl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
                tl.store(count_ptr + pid_n, 0)  # ready for the next launch
        else:
            if HAS_BIAS:
                out += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + y_offs, out.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
        M, N, K, k_iters, num_splits, stride_xm, stride_wn,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
        USE_DOT: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
        STATIC_ITERS: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
    ):
        # Program (pid_n, pid_k): output rows [pid_n * BLOCK_N, +BLOCK_N) of y [M, N] over the
        # K tiles [pid_k * k_iters, +k_iters). With SPLIT, each program writes its fp32 partial
        # sums to part [num_splits, M, N]; the last split of a tile to finish adds them all.
        # PREFETCH (EVEN_K, num_stages 1): each iteration issues the next W tile's load into
        # registers before using the current one, so its latency overlaps this tile's math.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_start = pid_k * k_iters * BLOCK_K
        pdl_wait(PDL)
        # int64 row offsets: N * K passes 2^31 for large vocabularies.
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        if USE_DOT:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
            w_ptrs = w_ptrs[:, None, :]  # [BLOCK_N, 1, BLOCK_K]
            # x's pointers spread over the whole [BLOCK_N, BLOCK_M, BLOCK_K] tile: a thread then
            # loads (from L1) the x values it multiplies, in the same layout as its W values;
            # a [BLOCK_M, BLOCK_K] load would cost a shared-memory layout conversion of the W
            # tile (and barriers) on every iteration.
            x_ptrs = x_ptrs[None, :, :] + tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.int32)
        # Triton's interpreter cannot loop to a runtime bound; it gets the count as a constant.
        PF: tl.constexpr = PREFETCH and EVEN_K
        if PF:
            wn_mask = n_mask[:, None] if USE_DOT else n_mask[:, None, None]
            w_next = tl.load(w_ptrs, mask=wn_mask, other=0.0)
        for it in tl.range(0, STATIC_ITERS if STATIC_ITERS > 0 else k_iters,
                           num_stages=NUM_STAGES):
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
            if not EVEN_K:
                k_mask = (k_start + it * BLOCK_K + offs_k < K)[None, :]
                w_mask = w_mask & k_mask
                x_mask = x_mask & k_mask
            if PF:  # this tile was loaded last iteration; the next one goes out now
                w = w_next
                more = (offs_n * 0 + it + 1) < (STATIC_ITERS if STATIC_ITERS > 0 else k_iters)
                more = more[:, None] if USE_DOT else more[:, None, None]
                w_next = tl.load(w_ptrs + BLOCK_K, mask=wn_mask & more, other=0.0)
            elif USE_DOT:
                w = tl.load(w_ptrs, mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
            else:
                w = tl.load(w_ptrs, mask=w_mask[:, None, :], other=0.0)
            if USE_DOT:
                x = tl.load(x_ptrs, mask=x_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
                if IEEE:
                    acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, tl.trans(x), acc)
            else:
                x = tl.load(x_ptrs, mask=x_mask[None, :, :], other=0.0)  # [BN, BM, BK]
                acc += w.to(tl.float32) * x.to(tl.float32)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if USE_DOT:
            out = acc  # [BLOCK_N, BLOCK_M]
        else:
            out = tl.sum(acc, axis=2)
        split_k_epilogue(out, y_ptr, b_ptr, part_ptr, count_ptr, offs_n, offs_m, n_mask, m_mask,
                         pid_n, pid_k, M, N, num_splits, HAS_BIAS, SPLIT, BLOCK_N, BLOCK_M)
