"""Long prompt chunks through torch's fused attention (cuDNN's kernel on the GPU): the chunk's
context gathered out of the pages a segment of keys at a time, each segment's attention merged
into the chunk's by log-sum-exp. Reference: paged_attention_ref (ops/attention_ref.py), whose
extend contract this keeps for one sequence.

Past a few thousand query tokens a chunk's attention is a dense problem of FLOPs: copying its
K and V out of the pages costs a few percent of the work (bytes against FLOPs), and a dense
kernel tuned by the GPU's vendor then runs it. bench/kernels/prefill_attention_speed.py
measures the paged Triton kernel against it; ops/attention.py dispatches here the extends
`long_extends` picks (those of at least DENSE_MIN_QUERY query tokens and DENSE_MIN_WORK query x
context pairs, where `dense_backend` finds a kernel).

A segment's keys all precede the chunk (no mask); the chunk's own keys are its causal square
(top-left and bottom-right masks agree there), so no kernel needs a bottom-right mask. Sliding
windows and attention sinks stay on the Triton kernels.
"""

from __future__ import annotations

import os

import torch

from skyline import envs
from skyline.ops.attention_ref import causal_mask

# Where cuDNN beats the paged Triton kernel (H100, bench/kernels/prefill_attention_speed.py):
# chunks of 8,192 queries over 8,192-131,072 keys (1.1-1.6x), 2,048 over 32,768 (1.05x), not
# 2,048 over 2,048 nor 1,024 over 16,384 (0.5-0.6x). So an extend goes dense from
# DENSE_MIN_QUERY query tokens (SKYLINE_DENSE_PREFILL_TOKENS overrides; 0: never) whose
# queries x context keys reach DENSE_MIN_WORK.
DENSE_MIN_QUERY = 2048
DENSE_MIN_WORK = 2048 * 32768
# context keys gathered (and attended) per call: 64 Ki keys of 8 KV heads of 128 in bf16 are
# 256 MiB of K and V
SEGMENT = 65536

_BACKENDS: dict[str, str | None] = {}

# cuDNN builds an execution plan for every new shape (~0.4 s each), and a long prompt's chunks
# meet new context lengths all the time. With this set, torch keys its cuDNN plans by lengths
# rounded up to powers of two for q, k, v laid out as [batch, seq, heads, dim] (this file's
# are), so a few plans serve every chunk. torch reads it once, at its first cuDNN attention;
# a value the user set stands.
os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")


def dense_backend(q: torch.Tensor, num_kv_heads: int) -> str | None:
    """The dense kernel for queries like `q` [T, H, D]: "cudnn" where torch's cuDNN attention
    runs them (a CUDA device, fp16 / bf16, checked once per device and head layout),
    "cudnn-expand" where it does only with K/V repeated to every query head, else None (the
    paged kernels)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    key = f"{q.device}:{q.dtype}:{q.shape[1]}:{num_kv_heads}:{q.shape[2]}"
    if key not in _BACKENDS:
        _BACKENDS[key] = _probe(q, num_kv_heads)
    return _BACKENDS[key]


def min_query() -> int:
    """Query tokens from which an extend may go dense (0: none)."""
    least = envs.ENV.dense_prefill_tokens
    return DENSE_MIN_QUERY if least < 0 else least


def long_extends(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: list[int],
                 seq_lens: list[int], extends: range, window: int,
                 sinks: torch.Tensor | None) -> list[int]:
    """Which of the sequences `extends` dense_extend runs: those of at least min_query() new
    tokens whose new tokens x context reach DENSE_MIN_WORK, where there is a dense backend
    and neither a window nor sinks."""
    least = min_query()
    if (least <= 0 or window or sinks is not None
            or dense_backend(q, kv_cache.shape[3]) is None):
        return []
    out = []
    for i in extends:
        t = query_start_loc[i + 1] - query_start_loc[i]
        if t >= least and t * seq_lens[i] >= DENSE_MIN_WORK:
            out.append(i)
    return out


def workspace_bytes(num_heads: int, num_kv_heads: int, head_dim: int, max_query: int,
                    elem: int) -> int:
    """Device memory dense_extend holds beside its output at most, for chunks of up to
    `max_query` tokens (0 when no chunk can reach min_query()):
    one segment's gathered K and V, the running fp32 output and its float copy of a segment's,
    and two kernel outputs of `elem`-byte values. The start-up profile adds it (its forward
    takes no paged attention)."""
    least = min_query()
    if least <= 0 or max_query < least:
        return 0
    rows = max_query * num_heads * head_dim
    return 2 * SEGMENT * num_kv_heads * head_dim * elem + rows * (8 + 2 * elem)


def _probe(q: torch.Tensor, kvh: int) -> str | None:
    # one tiny call of each shape the path makes: a kernel that refuses them is not used;
    # one that refuses shared KV heads gets K and V repeated ("cudnn-expand")
    h, d = q.shape[1], q.shape[2]
    qs = torch.zeros(1, h, 64, d, device=q.device, dtype=q.dtype)
    ks = torch.zeros(1, kvh, 128, d, device=q.device, dtype=q.dtype)
    for backend in ("cudnn", "cudnn-expand"):
        try:
            attend_lse(qs, ks, ks, False, 1.0, backend)
            attend_lse(qs, ks[:, :, :64], ks[:, :, :64], True, 1.0, backend)
            return backend
        except (RuntimeError, NotImplementedError):
            continue
    return None


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               backend: str, lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [1, H, T, D] in q's dtype, natural log-sum-exp of each row's scores [1, H, T]
    fp32, or None unless `lse`) of q [1, H, T, D] over k, v [1, KVH, S, D] (KV heads shared
    by H / KVH query heads each); `causal`: T == S, query i sees keys up to i. Without `lse`
    cuDNN skips computing it (a prompt's first chunk merges with nothing). backend: torch's
    "cudnn" or "flash" (FlashAttention-2, which bench/kernels/prefill_attention_speed.py
    compares), either with "-expand" (K/V repeated to every query head first), or "math"
    (PyTorch: the CPU, tests)."""
    if backend.endswith("-expand") and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    kernel = backend.removesuffix("-expand")
    if kernel == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, causal,
                                                                False, scale=scale)
        return r[0], r[1].reshape(q.shape[:3]).float() if lse else None
    if kernel == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                scale=scale)
        return r[0], r[1].reshape(q.shape[:3]).float()
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, 1)
    vf = v.float().repeat_interleave(group, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~causal_mask(0, n, 0, s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ vf).to(q.dtype), lse


def gather_kv(kv_cache: torch.Tensor, pages: torch.Tensor, start: int, end: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of context positions [start, end) out of the pages listed in `pages` (a block
    table row), as [1, KVH, end - start, D] views of one contiguous copy in `dtype` (an fp8
    cache's values converted exactly, still divided by their scales)."""
    page = kv_cache.shape[2]
    first, last = start // page, -(-end // page)
    kv = kv_cache.index_select(1, pages[first:last])  # [2, n, page, KVH, D]
    kv = kv.flatten(1, 2)[:, start - first * page:end - first * page]
    if kv.dtype != dtype:
        kv = kv.to(dtype)
    return kv[0][None].transpose(1, 2), kv[1][None].transpose(1, 2)


def dense_extend(q: torch.Tensor, kv_cache: torch.Tensor, pages: torch.Tensor, seq_len: int,
                 scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                 backend: str | None = None, segment: int = SEGMENT) -> torch.Tensor:
    """Attention of one sequence's T new tokens q [T, H, D], at positions seq_len - T ..
    seq_len - 1, over its context in `kv_cache` [2, blocks, page, KVH, D] (its K and V
    already written there) on the pages of block table row `pages`: [T, H, D]. `backend`
    (attend_lse's): None, dense_backend's."""
    backend = backend or dense_backend(q, kv_cache.shape[3])
    assert backend is not None, "no dense attention kernel for these queries"
    t = q.shape[0]
    prior = seq_len - t
    if backend.endswith("-expand"):  # the repeated K/V of a segment take no more than SEGMENT's
        segment = max(kv_cache.shape[2], segment * kv_cache.shape[3] // q.shape[1])
    qh = q.transpose(0, 1)[None]  # [1, H, T, D]
    s = scale * k_scale
    k, v = gather_kv(kv_cache, pages, prior, seq_len, q.dtype)
    out, lse = attend_lse(qh, k, v, True, s, backend, lse=prior > 0)
    acc = None
    for lo in range(0, prior, segment):
        k, v = gather_kv(kv_cache, pages, lo, min(prior, lo + segment), q.dtype)
        o, l2 = attend_lse(qh, k, v, False, s, backend)
        if acc is None:
            acc = out.float()
        # the running output moves towards this segment's by its share of the softmax mass
        acc.lerp_(o.float(), torch.sigmoid(l2 - lse)[..., None])
        lse = torch.logaddexp(lse, l2)
    res = out if acc is None else acc
    if v_scale != 1.0:
        res = res * v_scale
    return res[0].transpose(0, 1).to(q.dtype)
