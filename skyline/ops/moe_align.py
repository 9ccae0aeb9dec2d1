"""The MoE's (token, expert) pairs p = token * k + j sorted by expert into blocks of block_m
rows, each expert's rows padded to whole blocks, for the grouped GEMM (ops/moe_triton.py): in
tensors whose sizes depend only on the pair count (no host sync: CUDA graphs capture it).

`moe_align_ref` is the PyTorch reference (and the CPU path): a stable argsort and ~30 small
ops, each a launch of a few microseconds on a GPU, in every MoE layer of every step past the
decode GEMVs' few tokens. `moe_align` does the same on CUDA in four Triton launches, with the
reference's result exactly (within an expert the pairs keep their order):

1. counts: one program per CHUNK pairs, the chunk's histogram over the local experts;
2. offsets: one program per expert, an exclusive scan of its counts over the chunks (where
   each chunk's pairs of it start among the expert's) and its total;
3. blocks: one program per BLOCK_B blocks, each redoing the scan over the experts' padded
   totals (a few hundred values): every block's expert, its rows filled with padding (P), and
   (program 0) each expert's first row;
4. scatter: one program per chunk, each pair to its expert's first row + its chunk's offset +
   its rank among the chunk's pairs of that expert (a CHUNK x CHUNK comparison).
"""

from __future__ import annotations

import torch

from skyline import envs
from skyline.ops.triton_utils import tl, triton

CHUNK = 128  # pairs a program of the counts and scatter kernels
SCAN_TILE = 256  # chunks an offsets program scans at once
BLOCK_B = 64  # blocks a blocks program covers


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    # [T * k] int64: each pair's expert among this rank's, -1 where another rank holds it
    flat = topk_ids.flatten().long()
    return flat if expert_map is None else expert_map.long()[flat]


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks enough for any routing: the pairs' own plus one partial block per expert."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (sorted_ids [num_blocks * block_m] int32: pair ids, P = T * k where padding;
    block_experts [num_blocks] int32: each block's local expert, -1 for blocks past the last).
    Pairs of experts held elsewhere are left out."""
    ids = local_ids(topk_ids, expert_map)
    num_pairs = ids.numel()
    blocks = num_blocks(num_pairs, num_experts, block_m)
    key = torch.where(ids < 0, num_experts, ids)  # left-out pairs sort last
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync, which
    # CUDA graph capture forbids)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in `order`
    keep = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=ids.device) - first[e]
    scratch = blocks * block_m  # one slot past the end takes the left-out pairs
    dest = torch.where(keep, ends[e] - padded[e] + rank, scratch)
    sorted_ids = torch.full((scratch + 1,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_experts = torch.searchsorted(ends, starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_ids[:scratch], block_experts.to(torch.int32)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align_ref's contract; four Triton launches on CUDA (SKYLINE_UNFUSE=moe_align: the
    reference there too)."""
    if topk_ids.is_cuda and triton is not None and "moe_align" not in envs.ENV.unfuse:
        return moe_align_triton(topk_ids, num_experts, block_m, expert_map)
    return moe_align_ref(topk_ids, num_experts, block_m, expert_map)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     expert_map: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels behind moe_align (any device Triton runs on)."""
    ids = topk_ids.flatten()
    num_pairs = ids.numel()
    if num_pairs == 0:
        return moe_align_ref(topk_ids, num_experts, block_m, expert_map)
    blocks = num_blocks(num_pairs, num_experts, block_m)
    chunks = triton.cdiv(num_pairs, CHUNK)
    e_pad = triton.next_power_of_2(num_experts + 1)  # a bin for the pairs left out
    dev = ids.device
    i32 = dict(dtype=torch.int32, device=dev)
    counts = torch.empty(chunks, num_experts, **i32)
    offsets = torch.empty(chunks, num_experts, **i32)
    totals = torch.empty(num_experts, **i32)
    starts = torch.empty(num_experts, **i32)
    sorted_ids = torch.empty(blocks * block_m, **i32)
    block_experts = torch.empty(blocks, **i32)
    emap = expert_map if expert_map is not None else ids
    has_map = expert_map is not None
    _counts_kernel[(chunks,)](ids, emap, counts, num_pairs, num_experts, HAS_MAP=has_map,
                              CHUNK=CHUNK, E_PAD=e_pad)
    _offsets_kernel[(num_experts,)](counts, offsets, totals, chunks, num_experts,
                                    TILE=SCAN_TILE)
    _blocks_kernel[(triton.cdiv(blocks, BLOCK_B),)](
        totals, starts, block_experts, sorted_ids, blocks, num_pairs, num_experts, block_m,
        E_PAD=e_pad, BLOCK_B=BLOCK_B, BM_PAD=triton.next_power_of_2(block_m))
    _scatter_kernel[(chunks,)](ids, emap, offsets, starts, sorted_ids, num_pairs, num_experts,
                               HAS_MAP=has_map, CHUNK=CHUNK, num_warps=8)
    return sorted_ids, block_experts


if triton is not None:

    @triton.jit
    def _chunk_keys(ids_ptr, map_ptr, c, num_pairs, E, HAS_MAP: tl.constexpr,
                    CHUNK: tl.constexpr):
        # The chunk's pairs and their local experts (E: left out, or past the last pair)
        p = c * CHUNK + tl.arange(0, CHUNK)
        ok = p < num_pairs
        key = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
        if HAS_MAP:
            key = tl.load(map_ptr + key, mask=ok, other=-1).to(tl.int32)
        return p, tl.where(ok & (key >= 0), key, E)

    # The counts a step's shape varies (pairs, chunks, blocks) are not specialized on: no
    # kernel compiles again for a new token count once warm-up compiled it.
    @triton.jit(do_not_specialize=["num_pairs"])
    def _counts_kernel(ids_ptr, map_ptr, counts_ptr, num_pairs, E, HAS_MAP: tl.constexpr,
                       CHUNK: tl.constexpr, E_PAD: tl.constexpr):
        c = tl.program_id(0)
        _, key = _chunk_keys(ids_ptr, map_ptr, c, num_pairs, E, HAS_MAP, CHUNK)
        hist = tl.histogram(key, E_PAD)
        e = tl.arange(0, E_PAD)
        tl.store(counts_ptr + c * E + e, hist, mask=e < E)

    @triton.jit(do_not_specialize=["chunks"])
    def _offsets_kernel(counts_ptr, offsets_ptr, totals_ptr, chunks, E, TILE: tl.constexpr):
        e = tl.program_id(0)
        carry = tl.full((), 0, tl.int32)
        c0 = 0
        while c0 < chunks:  # (Triton's interpreter runs no range() to a runtime bound)
            c = c0 + tl.arange(0, TILE)
            n = tl.load(counts_ptr + c * E + e, mask=c < chunks, other=0)
            tl.store(offsets_ptr + c * E + e, carry + tl.cumsum(n, 0) - n, mask=c < chunks)
            carry += tl.sum(n, 0)
            c0 += TILE
        tl.store(totals_ptr + e, carry)

    @triton.jit(do_not_specialize=["blocks", "num_pairs"])
    def _blocks_kernel(totals_ptr, starts_ptr, block_experts_ptr, sorted_ids_ptr, blocks,
                       num_pairs, E, block_m, E_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
                       BM_PAD: tl.constexpr):
        e = tl.arange(0, E_PAD)
        total = tl.load(totals_ptr + e, mask=e < E, other=0)
        padded = (total + block_m - 1) // block_m * block_m
        ends = tl.cumsum(padded, 0)
        if tl.program_id(0) == 0:
            tl.store(starts_ptr + e, ends - padded, mask=e < E)
        b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        # a block's expert: how many experts' rows end at or before its first row
        first = (b * block_m)[:, None]
        ex = tl.sum(((ends[None, :] <= first) & (e[None, :] < E)).to(tl.int32), 1)
        tl.store(block_experts_ptr + b, tl.where(ex < E, ex, -1), mask=b < blocks)
        r = tl.arange(0, BM_PAD)
        pad = tl.full((BLOCK_B, BM_PAD), 0, tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + first + r[None, :], pad,
                 mask=(b < blocks)[:, None] & (r < block_m)[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])
    def _scatter_kernel(ids_ptr, map_ptr, offsets_ptr, starts_ptr, sorted_ids_ptr, num_pairs,
                        E, HAS_MAP: tl.constexpr, CHUNK: tl.constexpr):
        c = tl.program_id(0)
        p, key = _chunk_keys(ids_ptr, map_ptr, c, num_pairs, E, HAS_MAP, CHUNK)
        i = tl.arange(0, CHUNK)
        before = (key[None, :] == key[:, None]) & (i[None, :] < i[:, None])
        rank = tl.sum(before.to(tl.int32), 1)
        keep = key < E
        ke = tl.where(keep, key, 0)
        dest = (tl.load(starts_ptr + ke, mask=keep, other=0)
                + tl.load(offsets_ptr + c * E + ke, mask=keep, other=0) + rank)
        tl.store(sorted_ids_ptr + dest, p, mask=keep)
