"""The EAGLE proposer: keeps each request's head state in step with the target and drafts
greedily with the head (worker/spec/eagle.py).

Feeding: every step the runner hands over the target's hidden states of the tokens it just
computed (`observe`: prefill chunks, decodes, and verified drafts). Head position t needs f_t
and the token x_{t+1}; rows whose next token is already known (prompt positions) are fed at
once, the rest wait for the step's sampling: at `propose` time the request's token ids say how
many verified drafts were accepted, the rows of rejected drafts are dropped, the others fed.
A request whose prompt prefix came from the prefix cache has no features there: its head
context starts at the first position the target computed.

Drafting: from the head's prediction at the last position, one head step per draft token
(batched over requests), greedy top-1, while the head's cumulative confidence (the product of
its top-1 probabilities) stays at or above `SpecConfig.draft_cost`: a draft less likely than
that to be accepted is not worth its verification. The target verifies every draft with exact
rejection sampling, so the output is the target's whatever the head proposes.

Copied spans: while a request repeats earlier text (its last `ngram_max` tokens occurred
before in it, e.g. an edited file being written out again), prompt lookup's continuation is
proposed instead of the head's drafts (`SpecConfig.eagle_lookup`): long exact copies are what
lookup guesses best and costs nothing to draft.

The head's K/V of every request is one paged pool held here (spec/head_cache.py); a request's
pages are taken as it grows and given back in `finish`, and a draft step over many requests
is one batched head forward.

Steps larger than `SpecConfig.max_batch_tokens` do not speculate (the scheduler's rule), so no
drafts are computed for them; the features are still fed, so that speculation can resume later.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from skyline.config import SpecConfig
from skyline.model.loader import prepack_for_cpu
from skyline.ops import cpu_linear
from skyline.worker.sampler import to_device
from skyline.worker.spec.eagle import AttnPlan, load_head, target_parts
from skyline.worker.spec.head_cache import HeadCache, HeadKVPool
from skyline.worker.spec.ngram import NgramProposer


class EagleProposer:
    def __init__(self, cfg: SpecConfig, model: nn.Module) -> None:
        assert cfg.model is not None, "SpecConfig validates that eagle has a head"
        dtype = _head_dtype(model)
        self.head = load_head(cfg.model, model, dtype)
        self.parts = target_parts(model, self.head.vocab_ids, dtype)
        if cpu_linear.can_pack(self.parts.lm_weight):  # the CPU: oneDNN-packed products
            prepack_for_cpu(self.head, dtype)
            self.parts.lm_packed = cpu_linear.pack(self.parts.lm_weight)
        self.vocab_ids = self.head.vocab_ids.tolist()
        self.min_confidence = cfg.draft_cost
        self.max_batch = cfg.max_batch_tokens
        self.max_position = model.model.rotary_emb.cos_sin_cache.shape[0]
        a = self.head.layer.self_attn
        w = self.parts.lm_weight
        self.dtype, self.device = w.dtype, w.device
        self.pool = HeadKVPool(a.attn.num_kv_heads, a.head_dim, self.dtype, self.device)
        self.caches: dict[str, HeadCache] = {}
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # rows awaiting their token
        self.last: dict[str, torch.Tensor] = {}  # [H] the head's f' at its last position
        self.lookup = (NgramProposer(cfg.ngram_max, cfg.ngram_max) if cfg.eagle_lookup
                       else None)

    # ------------------------------------------------------------------ feeding

    @torch.inference_mode()
    def observe(
        self,
        req_ids: Sequence[str],
        starts: Sequence[int],
        hidden: Sequence[torch.Tensor],
        token_ids: Sequence[Sequence[int]],
    ) -> None:
        feed = []
        for rid, start, rows, toks in zip(req_ids, starts, hidden, token_ids, strict=True):
            self.pending.pop(rid, None)  # never resolved: superseded by these rows
            known = max(0, min(len(toks) - 1 - start, rows.shape[0]))
            if known:
                feed.append((rid, start, rows[:known], toks[start + 1 : start + known + 1]))
            if known < rows.shape[0]:
                self.pending[rid] = (start + known, rows[known:].clone())
        self._feed(feed)

    def _resolve(self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> None:
        """Feed the waiting rows whose token is now known; the rest were rejected drafts."""
        feed = []
        for rid, toks in zip(req_ids, token_ids, strict=True):
            p = self.pending.pop(rid, None)
            if p is None:
                continue
            start, rows = p
            known = max(0, min(len(toks) - 1 - start, rows.shape[0]))
            if known:
                feed.append((rid, start, rows[:known], toks[start + 1 : start + known + 1]))
        self._feed(feed)

    def _feed(self, items: list[tuple[str, int, torch.Tensor, Sequence[int]]]) -> None:
        """Head positions start.. of each request: features f_t and next tokens x_{t+1}."""
        if not items:
            return
        caches, cstarts, lengths, positions, tokens = [], [], [], [], []
        for rid, start, rows, toks in items:
            c = self.caches.get(rid)
            if c is None or not c.base <= start <= c.base + c.length:
                # a new request, or a gap (features the target never computed for the head)
                if c is not None:
                    c.release()
                c = self.caches[rid] = HeadCache(start, self.pool)
            c.length = start - c.base  # a recompute overwrites from `start`
            n = rows.shape[0]
            caches.append(c)
            cstarts.append(c.length)
            lengths.append(n)
            positions.extend(range(start, start + n))
            tokens.extend(toks)
        feats = torch.cat([rows for _, _, rows, _ in items]).to(self.dtype)  # [T, H]
        out = self._step(tokens, feats, positions, AttnPlan(lengths, caches, cstarts))
        last = 0
        for (rid, _, _, _), c, n in zip(items, caches, lengths, strict=True):
            c.length += n
            last += n
            self.last[rid] = out[last - 1].clone()  # not a view pinning the whole batch

    def _step(self, tokens: list[int], feats: torch.Tensor, positions: list[int],
              plan: AttnPlan) -> torch.Tensor:
        """One head forward: the normed predicted features f' [T, H]."""
        ids = to_device(tokens, torch.int64, self.device)
        pos = to_device(positions, torch.int64, self.device)
        g = self.head(self.parts.embed(ids).to(self.dtype), feats, pos, plan)
        return self.parts.norm(g).to(self.dtype)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(
        self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]], max_depth: int
    ) -> list[list[int]]:
        self._resolve(req_ids, token_ids)
        drafts: list[list[int]] = [[] for _ in req_ids]
        if len(req_ids) > self.max_batch:
            return drafts  # a compute-bound step: the scheduler does not speculate
        if self.lookup is not None:
            drafts = self.lookup.propose(req_ids, token_ids, max_depth)
        active = [i for i, r in enumerate(req_ids)
                  if not drafts[i] and r in self.last
                  and self.caches[r].base + self.caches[r].length == len(token_ids[i]) - 1]
        if not active or max_depth == 0:
            return drafts
        # Each step's top-1 is read and only the requests still confident go on: drafting all
        # of them to max_depth with one read at the end runs more head steps than it saves.
        feats = torch.stack([self.last[req_ids[i]] for i in active])  # [B, H]
        conf = [1.0] * len(active)
        for j in range(max_depth):
            probs = self.parts.logits(feats).softmax(-1)  # [B, V']
            top_p, top_i = probs.max(-1)
            keep, toks = [], []
            for b, (p, t) in enumerate(zip(top_p.tolist(), top_i.tolist(), strict=True)):
                i = active[b]
                conf[b] *= p
                pos = len(token_ids[i]) + j  # position of this draft
                if conf[b] < self.min_confidence or pos >= self.max_position:
                    continue
                drafts[i].append(self.vocab_ids[t])
                keep.append(b)
                toks.append(self.vocab_ids[t])
            if not keep or j == max_depth - 1:
                break
            # Head position len - 1 + j reads f' and the draft just made (at len + j), into
            # scratch rows past the cache's length (never committed).
            active = [active[b] for b in keep]
            conf = [conf[b] for b in keep]
            caches = [self.caches[req_ids[i]] for i in active]
            positions = [len(token_ids[i]) - 1 + j for i in active]
            plan = AttnPlan([1] * len(active), caches, [c.length + j for c in caches])
            feats = self._step(toks, feats[keep], positions, plan)
        return drafts

    def finish(self, req_id: str, token_ids: Sequence[int]) -> None:
        if self.lookup is not None:
            self.lookup.finish(req_id, token_ids)
        c = self.caches.pop(req_id, None)
        if c is not None:
            c.release()
        self.pending.pop(req_id, None)
        self.last.pop(req_id, None)


def _head_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype the head drafts in: bfloat16 for a float32 model on a CPU with native bfloat16
    products (half the bytes per draft step; the drafts only need to be likely, the target
    verifies them exactly), else the model's (None)."""
    w = model.lm_head.weight
    if (w.device.type == "cpu" and w.dtype == torch.float32
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.bfloat16
    return None
