"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's own last n tokens (n from max_n down to min_n). No model, only token ids."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """The latest occurrence of every n-gram (min_n <= n <= max_n) of one growing token list.

    Invariant: an n-gram is indexed by the position right after it (where its continuation
    starts), for every position < len(tokens) seen so far. The sequence's own final n-gram has
    no continuation yet, so a lookup of it finds its latest *earlier* occurrence.
    """

    __slots__ = ("min_n", "max_n", "tables", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tables: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self.num_indexed = 0  # continuation positions [0, num_indexed) are in the tables

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the n-grams ending before each new position (tokens only ever grow)."""
        if len(tokens) < self.num_indexed:  # not the list we indexed (never in the engine)
            for table in self.tables.values():
                table.clear()
            self.num_indexed = 0
        for e in range(self.num_indexed, len(tokens)):
            for n, table in self.tables.items():
                if e >= n:
                    table[tuple(tokens[e - n : e])] = e
        self.num_indexed = max(self.num_indexed, len(tokens))

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(n, continuation position) of the longest indexed n-gram equal to the suffix of
        `tokens`; (0, -1) if none."""
        total = len(tokens)
        for n in range(min(self.max_n, total), self.min_n - 1, -1):
            e = self.tables[n].get(tuple(tokens[total - n :]))
            if e is not None:
                return n, e
        return 0, -1


def continuation(source: Sequence[int], start: int, depth: int) -> list[int]:
    """`depth` tokens of `source` from `start`. Past the end, the proposal continues from
    itself, so a repeating pattern near the end of the sequence is proposed at full depth."""
    out: list[int] = []
    total = len(source)
    for i in range(depth):
        p = start + i
        out.append(source[p] if p < total else out[p - total])
    return out


class NgramProposer:
    """Prompt-lookup decoding over each request's prompt and output."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.indexes: dict[str, NgramIndex] = {}

    def _index(self, req_id: str, tokens: Sequence[int]) -> NgramIndex:
        idx = self.indexes.get(req_id)
        if idx is None:
            idx = self.indexes[req_id] = NgramIndex(self.min_n, self.max_n)
        idx.extend(tokens)
        return idx

    def propose(
        self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]], max_depth: int
    ) -> list[list[int]]:
        if max_depth <= 0:  # a plain step: the index catches up when drafts are wanted again
            return [[] for _ in req_ids]
        out = []
        for rid, tokens in zip(req_ids, token_ids, strict=True):
            n, e = self._index(rid, tokens).match(tokens)
            out.append(continuation(tokens, e, max_depth) if n else [])
        return out

    def finish(self, req_id: str, token_ids: Sequence[int]) -> None:
        self.indexes.pop(req_id, None)
