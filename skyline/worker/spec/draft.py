"""The draft-model proposer: a smaller model with the target's tokenizer drafts greedily, with
its own paged KV cache in the same engine.

The draft is loaded like the target (`load_model`: HF directory, GGUF file or shipped dummy
config; the target's device and dtype), or, with `SpecConfig.draft_layers` N and no draft
model, made of the target's own first N layers, final norm and LM head (`truncated_model`:
every weight shared, only the KV cache its own).

Per step (`propose`, batched over the requests that just sampled):
1. catch up: one forward over each request's tokens that the draft has not computed yet (the
   tokens the target accepted since the last step, the whole prompt the first time; prefill-
   like, with the same paged attention as the target); its logits at each last token give the
   first draft;
2. draft: one decode forward per further draft token, greedy, while the draft's cumulative
   confidence (the product of its top-1 probabilities) stays at or above
   `SpecConfig.draft_cost`, as the EAGLE proposer does.
Drafts are point masses, so the target's verification (spec/verify.py) keeps its output
exactly the target's, greedy or sampled, seeded or not, whatever the draft proposes.

KV bookkeeping: a request's draft KV is valid for positions [0, num_computed_tokens) of its
tokens. Drafting writes the KV of the drafts it feeds past that point (`scratch`); at the next
step the ones the target accepted are kept, the others are overwritten by the catch-up. The
blocks come from a `BlockPool` of the draft's own (no prefix caching) holding as many token
slots as the target's cache: the runner sizes both caches from one memory budget
(`kv_bytes_per_block`), and the draft's is allocated at first use. They go back in `finish`.
A request whose blocks do not fit gets no drafts this step: the target never waits for the
draft.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence

import torch
from torch import nn

from skyline.cache.block_pool import BlockPool, KVCacheBlock
from skyline.config import SpecConfig
from skyline.model.forward_ctx import forward_context
from skyline.model.layers.attention import Attention
from skyline.model.loader import load_model, prepack_for_cpu
from skyline.types import SamplingParams
from skyline.worker.inputs import RequestState, build_inputs
from skyline.worker.kv_cache import allocate_kv_cache, bytes_per_block

log = logging.getLogger(__name__)

CATCHUP_TOKENS = 2048  # most tokens in one catch-up forward (a long prompt takes several)
CUDA_FREE_FRACTION = 0.8  # of the device memory free when the draft's cache is allocated
BLOCK_SIZE = 16  # when the target has no cache bound (the proposer used on its own)
_NO_PARAMS = SamplingParams()  # the draft's RequestStates only place tokens; nothing samples


def truncated_model(target: nn.Module, num_layers: int) -> nn.Module:
    """The target's first `num_layers` layers, final norm and LM head as a model of its own:
    every parameter and buffer shared, every Attention module its own (it binds its own KV
    cache)."""
    draft = _share(target)
    draft.model.layers = nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.arch = dataclasses.replace(target.arch, num_layers=num_layers)
    return draft


def _share(module: nn.Module) -> nn.Module:
    new = copy.copy(module)  # the same parameter and buffer tensors
    for name, value in vars(module).items():
        if isinstance(value, dict):  # registries (parameters, buffers, hooks): its own
            new.__dict__[name] = copy.copy(value)
    if isinstance(module, Attention):
        new.kv_cache = None
        new.k_scale = new.v_scale = 1.0
    new._modules = {name: None if m is None else _share(m)
                    for name, m in module._modules.items()}
    return new


@dataclasses.dataclass
class _Seq:
    """One request's draft state. `state.num_computed_tokens`: positions whose draft KV is
    valid; `state.token_ids`: this step's tokens and drafts (empty between steps)."""

    state: RequestState
    blocks: list[KVCacheBlock]
    scratch: list[int]  # drafts whose KV follows num_computed_tokens (fed at the last step)


class DraftProposer:
    def __init__(self, cfg: SpecConfig, target: nn.Module, num_blocks: int | None = None) -> None:
        w = target.lm_head.weight
        self.dtype, self.device = w.dtype, w.device
        if cfg.draft is not None:
            self.model = load_model(cfg.draft, self.device)
            if self.device.type == "cpu":
                prepack_for_cpu(self.model, self.dtype)
        else:
            assert 0 < cfg.draft_layers <= target.arch.num_layers, "create.py checks the layers"
            self.model = truncated_model(target, cfg.draft_layers)
        self.target = target
        self.arch = self.model.arch
        self.min_confidence = cfg.draft_cost
        self.max_batch = cfg.max_batch_tokens
        self.max_position = min(self.model.model.rotary_emb.cos_sin_cache.shape[0],
                                target.model.rotary_emb.cos_sin_cache.shape[0])
        self.num_blocks = num_blocks  # None: as many token slots as the target's cache
        self.pool: BlockPool | None = None  # allocated at first use (`_allocate`)
        self.allocated = False
        self.block_size = BLOCK_SIZE
        self.seqs: dict[str, _Seq] = {}

    # ------------------------------------------------------------------ the cache

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of the draft's KV cache per block of `block_size` tokens: the runner adds
        them to the target's per-block bytes when it sizes the cache, then sets `num_blocks`
        so that both caches hold the same tokens within one budget."""
        return bytes_per_block(self.arch, block_size, self.dtype)

    def _allocate(self) -> bool:
        """Allocate the draft's KV cache (once); False if no memory is left for it."""
        if self.allocated:
            return self.pool is not None
        self.allocated = True
        bound = self.target.attention_layers()[0].kv_cache  # [2, blocks, block_size, ...]
        want = -(-self.max_position // self.block_size)  # one full-length request
        if bound is not None:
            self.block_size = bound.shape[2]  # the target's: the kernels are tuned for it
            want = bound.shape[1]
        per_block = bytes_per_block(self.arch, self.block_size, self.dtype)
        if self.num_blocks is not None:
            want = self.num_blocks
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(
                self.device)
            want = min(want, int(free * CUDA_FREE_FRACTION) // per_block)
        if want < 1:
            log.warning("no device memory is left for the draft model's KV cache: no drafts; "
                        "lower --gpu-memory-utilization to speculate")
            return False
        self.pool = BlockPool(want, enable_caching=False)
        caches = allocate_kv_cache(self.arch, want, self.block_size, self.dtype, self.device)
        for layer, cache in zip(self.model.attention_layers(), caches, strict=True):
            layer.kv_cache = cache
        log.info("draft model KV cache: %d blocks of %d tokens (%.0f MiB)", want,
                 self.block_size, want * per_block / 2**20)
        return True

    def _reserve(self, seq: _Seq, num_slots: int) -> bool:
        """Blocks for positions [0, num_slots) of the request; False if the pool is short."""
        assert self.pool is not None
        need = -(-num_slots // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        new = self.pool.get_new_blocks(need)
        seq.blocks.extend(new)
        seq.state.block_ids.extend(b.block_id for b in new)
        return True

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(
        self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]], max_depth: int
    ) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in req_ids]
        if len(req_ids) > self.max_batch or not self._allocate():
            return drafts  # a compute-bound step (the scheduler does not speculate), or no cache
        active: list[int] = []  # indices into req_ids, in batch order
        depths: list[int] = []
        for i, (rid, toks) in enumerate(zip(req_ids, token_ids, strict=True)):
            depth = min(max_depth, self.max_position - len(toks))
            seq = self.seqs.get(rid)
            if seq is None:
                seq = self.seqs[rid] = _Seq(RequestState(rid, [], [], _NO_PARAMS, [], 0), [], [])
            self._keep_accepted(seq, toks)
            # The last draft is never fed: slots up to position len + depth - 2.
            if depth < 1 or not self._reserve(seq, len(toks) + depth - 1):
                continue
            seq.state.token_ids = list(toks)
            active.append(i)
            depths.append(depth)
        if not active:
            return drafts
        seqs = [self.seqs[req_ids[i]] for i in active]
        lengths = [len(token_ids[i]) for i in active]
        logits = self._catch_up(seqs)  # [B, vocab]
        conf = [1.0] * len(active)
        while True:
            top_p, top_i = logits.softmax(-1).max(-1)
            keep = []
            for b, (p, t) in enumerate(zip(top_p.tolist(), top_i.tolist(), strict=True)):
                conf[b] *= p
                if conf[b] < self.min_confidence:
                    continue
                i = active[b]
                drafts[i].append(t)
                if len(drafts[i]) < depths[b]:
                    keep.append(b)
            if not keep:
                break
            active = [active[b] for b in keep]
            depths = [depths[b] for b in keep]
            conf = [conf[b] for b in keep]
            fed = [self.seqs[req_ids[i]] for i in active]
            for i, s in zip(active, fed, strict=True):
                s.state.token_ids.append(drafts[i][-1])
            logits = self._forward(fed, {s.state.req_id: 1 for s in fed})
        for s, n in zip(seqs, lengths, strict=True):
            s.scratch = s.state.token_ids[n : s.state.num_computed_tokens]
            s.state.num_computed_tokens = n
            s.state.token_ids = []
        return drafts

    def _keep_accepted(self, seq: _Seq, toks: Sequence[int]) -> None:
        """Keep the KV of last step's fed drafts that the target accepted."""
        n = seq.state.num_computed_tokens
        rest = toks[n : n + len(seq.scratch)]
        m = 0
        while m < len(rest) and rest[m] == seq.scratch[m]:
            m += 1
        # The last token is always fed again: its logits give the first draft.
        seq.state.num_computed_tokens = max(0, min(n + m, len(toks) - 1))
        seq.scratch = []

    def _catch_up(self, seqs: list[_Seq]) -> torch.Tensor:
        """Feed every token the draft has not computed, CATCHUP_TOKENS per forward at most;
        the logits at each request's last token [len(seqs), vocab]."""
        rows: dict[str, torch.Tensor] = {}
        todo = list(seqs)
        while todo:
            sched: dict[str, int] = {}
            room = CATCHUP_TOKENS
            for s in todo:
                n = min(len(s.state.token_ids) - s.state.num_computed_tokens, room)
                if n < 1:
                    break
                sched[s.state.req_id] = n
                room -= n
            batch = [s for s in todo if s.state.req_id in sched]
            logits = self._forward(batch, sched)
            done = [s for s in batch
                    if s.state.num_computed_tokens == len(s.state.token_ids)]
            rows.update(zip((s.state.req_id for s in done), logits, strict=True))
            todo = [s for s in todo if s.state.num_computed_tokens < len(s.state.token_ids)]
        return torch.stack([rows[s.state.req_id] for s in seqs])

    def _forward(self, seqs: list[_Seq], num_scheduled: dict[str, int]) -> torch.Tensor:
        """One draft forward of `num_scheduled[r]` tokens of each request from its
        num_computed_tokens; the logits of the requests it brings to their end, in `seqs`
        order [num_done, vocab]."""
        states = {s.state.req_id: s.state for s in seqs}
        inp = build_inputs(states, num_scheduled, self.block_size, self.device)
        with forward_context(inp.attn):
            hidden = self.model(inp.input_ids, inp.positions)  # [num_tokens, hidden]
        for rid, n in num_scheduled.items():
            states[rid].num_computed_tokens += n
        logits = self.model.compute_logits(hidden[inp.logits_indices])  # [num_done, vocab]
        row = {r: j for j, r in enumerate(inp.sampling_req_ids)}
        order = [row[s.state.req_id] for s in seqs if s.state.req_id in row]
        return logits[order]

    def finish(self, req_id: str, token_ids: Sequence[int]) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None and self.pool is not None:
            self.pool.free_blocks(reversed(seq.blocks))
