"""Suffix lookup over the request itself and recent traffic: text that other requests already
produced (a shared system prompt, boilerplate answers, a document everyone quotes) is proposed
with no draft model. The longest match of the request's suffix wins; the request's own history
wins ties, being the more specific source."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from skyline.worker.spec.ngram import NgramIndex, continuation


class TrafficIndex:
    """n-grams of recently finished sequences -> (sequence id, continuation position), latest
    occurrence wins. Holds at most about `max_tokens` tokens; the oldest sequences go first.
    Sequences are indexed at the first `match` after they were added, so that a stretch of
    plain decoding (many requests finishing, none proposing) costs nothing here."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.max_tokens = max_tokens
        self.seqs: dict[int, list[int]] = {}
        self.order: deque[int] = deque()
        self.num_tokens = 0
        self.next_id = 0
        self.pending: list[int] = []  # added, not indexed yet
        self.tables: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {
            n: {} for n in range(min_n, max_n + 1)
        }

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) <= self.min_n or self.max_tokens <= 0:
            return
        sid = self.next_id
        self.next_id += 1
        seq = list(tokens[-self.max_tokens :])
        self.seqs[sid] = seq
        self.order.append(sid)
        self.num_tokens += len(seq)
        self.pending.append(sid)
        if self.num_tokens > self.max_tokens:
            # Evict the oldest quarter at once and rebuild, so that stale entries never pile up.
            while self.num_tokens > self.max_tokens * 3 // 4 and len(self.order) > 1:
                self.num_tokens -= len(self.seqs.pop(self.order.popleft()))
            for table in self.tables.values():
                table.clear()
            self.pending = list(self.order)

    def _catch_up(self) -> None:
        for sid in self.pending:
            if sid in self.seqs:
                self._index(sid, self.seqs[sid])
        self.pending.clear()

    def _index(self, sid: int, seq: list[int]) -> None:
        for e in range(len(seq)):
            for n, table in self.tables.items():
                if e >= n:
                    table[tuple(seq[e - n : e])] = (sid, e)

    def match(self, tokens: Sequence[int], min_n: int) -> tuple[int, list[int], int]:
        """(n, source sequence, continuation position) of the longest match of at least
        `min_n` tokens; (0, [], -1) if none."""
        if self.pending:
            self._catch_up()
        total = len(tokens)
        for n in range(min(self.max_n, total), max(self.min_n, min_n) - 1, -1):
            hit = self.tables[n].get(tuple(tokens[total - n :]))
            if hit is not None:
                return n, self.seqs[hit[0]], hit[1]
        return 0, [], -1


class SuffixProposer:
    """Longest-suffix match over the request's own tokens, then over recent traffic."""

    def __init__(self, min_n: int, max_n: int, max_traffic_tokens: int = 1 << 18) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.own: dict[str, NgramIndex] = {}
        self.traffic = TrafficIndex(min_n, max_n, max_traffic_tokens)

    def propose(
        self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]], max_depth: int
    ) -> list[list[int]]:
        if max_depth <= 0:  # a plain step: the indexes catch up when drafts are wanted again
            return [[] for _ in req_ids]
        out = []
        for rid, tokens in zip(req_ids, token_ids, strict=True):
            idx = self.own.get(rid)
            if idx is None:
                idx = self.own[rid] = NgramIndex(self.min_n, self.max_n)
            idx.extend(tokens)
            n, e = idx.match(tokens)
            tn, src, te = self.traffic.match(tokens, n + 1)
            if tn > n:
                out.append(continuation(src, te, max_depth)[: len(src) - te])
            elif n:
                out.append(continuation(tokens, e, max_depth))
            else:
                out.append([])
        return out

    def finish(self, req_id: str, token_ids: Sequence[int]) -> None:
        """The request left the runner (finished or preempted): its text joins the traffic."""
        self.own.pop(req_id, None)
        self.traffic.add(token_ids)
