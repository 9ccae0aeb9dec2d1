"""The EAGLE head's K/V: one paged pool for every request, in the layout of the target's KV
cache ([2, num_blocks, page, kv_heads, head_dim]), so that one head step over many requests
is one K/V write and one paged-attention call (ops/attention.py: Triton kernels on CUDA), not a
loop over requests.

The pool belongs to the proposer and sits outside the engine's KV budget: it holds one layer
for the tokens of the running requests and grows by doubling when a request needs a page and
none is free (rare: it keeps its size once the load is known).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skyline.ops.attention import paged_attention
from skyline.ops.kv_write import write_kv
from skyline.worker.sampler import to_device

PAGE = 16


class HeadKVPool:
    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, num_pages: int = 64) -> None:
        self.kv = torch.empty(2, num_pages, PAGE, num_kv_heads, head_dim, dtype=dtype,
                              device=device)
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    def alloc(self) -> int:
        if not self.free:
            n = self.num_pages
            kv = self.kv.new_empty(2, 2 * n, *self.kv.shape[2:])
            kv[:, :n] = self.kv
            self.kv = kv
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()

    def release(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))
        pages.clear()


class HeadCache:
    """One request's head K/V in the pool: row i (position `base + i`) lives in page
    `pages[i // PAGE]`. Rows past `length` are scratch: drafting writes there and the next
    observed feature overwrites them. `release` gives the pages back."""

    def __init__(self, base: int, pool: HeadKVPool) -> None:
        self.base = base
        self.length = 0
        self.pool = pool
        self.pages: list[int] = []

    def reserve(self, num_rows: int) -> None:
        """Make room for rows [0, num_rows)."""
        while len(self.pages) * PAGE < num_rows:
            self.pages.append(self.pool.alloc())

    def release(self) -> None:
        self.pool.release(self.pages)

    def slots(self, start: int, n: int) -> list[int]:
        return [self.pages[r // PAGE] * PAGE + r % PAGE for r in range(start, start + n)]


def attend_cached(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    lengths: Sequence[int],  # sequence i owns the next lengths[i] rows of q/k/v
    caches: Sequence[HeadCache],  # in one pool
    starts: Sequence[int],  # sequence i's rows go to cache rows starts[i]:
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Write each sequence's k/v to its cache rows, then attend causally: query j of sequence
    i (cache row starts[i] + j) sees rows 0..starts[i] + j of its cache."""
    pool = caches[0].pool
    dev = q.device
    slots: list[int] = []
    qsl = [0]
    seq_lens = []
    for c, s, n in zip(caches, starts, lengths, strict=True):
        c.reserve(s + n)
        slots += c.slots(s, n)
        qsl.append(qsl[-1] + n)
        seq_lens.append(s + n)
    width = max(len(c.pages) for c in caches)
    # host lists copied without waiting (a pageable copy would wait for the queued steps)
    table = to_device([x for c in caches for x in c.pages + [0] * (width - len(c.pages))],
                      torch.int32, dev).view(len(caches), width)
    write_kv(k, v, pool.kv, to_device(slots, torch.int64, dev))
    num_decodes = 0  # the leading one-row sequences, batched as decodes
    while num_decodes < len(lengths) and lengths[num_decodes] == 1:
        num_decodes += 1
    return paged_attention(
        q, pool.kv, qsl, seq_lens, table, scale, num_decodes,
        seq_lens_tensor=to_device(seq_lens, torch.int32, dev),
        query_start_loc_tensor=to_device(qsl, torch.int32, dev))
