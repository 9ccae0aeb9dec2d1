"""Which part of a dimension each tensor-parallel rank holds.

Attention is split by key/value head *groups* (a KV head and the query heads that read it), so
a rank's query heads always read KV heads it holds: with fewer KV heads than ranks each KV head
is replicated on `ranks / kv_heads` ranks and its query heads split among them; with more, the
groups are shared out as evenly as possible (9 query and 3 KV heads over 2 ranks: 6 + 3). Other
dimensions (the MLP's intermediate size, the vocabulary) split evenly.
"""

from __future__ import annotations

from dataclasses import dataclass

from skyline.config import ConfigError


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank holds: query heads [q_start, q_start + num_q), KV heads
    [kv_start, kv_start + num_kv) (global indices)."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of n items split into `parts` as evenly as possible (the
    first n % parts parts one larger)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """The heads rank `tp_rank` of `tp_size` holds; ConfigError where they cannot split."""
    if tp_size == 1:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= tp_size:
        kv_start, num_kv = split_evenly(num_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    if tp_size % num_kv_heads or group % (tp_size // num_kv_heads):
        raise ConfigError(
            f"{num_heads} attention heads with {num_kv_heads} KV heads cannot be split over "
            f"--tensor-parallel-size {tp_size}; use a size that divides {num_kv_heads} or a "
            f"multiple of it that divides {num_heads}")
    copies = tp_size // num_kv_heads  # ranks sharing each KV head
    kv = tp_rank // copies
    per_rank = group // copies
    return HeadShard(kv * group + (tp_rank % copies) * per_rank, per_rank, kv, 1)


def even_shard(n: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
    """(start, size) of an evenly divisible dimension; ConfigError naming `what` otherwise."""
    if n % tp_size:
        raise ConfigError(f"the {what} ({n}) is not divisible by --tensor-parallel-size "
                          f"{tp_size}; use a size that divides it")
    size = n // tp_size
    return tp_rank * size, size


def padded_shard(n: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(start, size, padded size) of a dimension split in equal parts of ceil(n / tp_size)
    (the vocabulary: the last part may hold fewer real rows, padded to the same size)."""
    per = -(-n // tp_size)
    start = min(tp_rank * per, n)
    return start, min(per, n - start), per
