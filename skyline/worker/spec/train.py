"""Training of an EAGLE head (eagle.py) by self-distillation (`skyline train-speculator`).

The target runs over the prompts and writes its own continuations (tools/speculator/data.py),
and its hidden state f_t at every position is taken (the `hidden_states` query). Head position
t then learns, from
f_t and the token x_{t+1}, to predict
- the target's next-token distribution softmax(lm_head(f_{t+1})) over the draft vocabulary
  (cross-entropy to it: the distillation term, computed on the fly from f_{t+1}, so no
  distribution is stored), and
- the feature f_{t+1} itself (smooth-L1 on features scaled to unit RMS: EAGLE's regression
  term), on the positions of the continuations.
Drafting feeds the head its own predictions, so training unrolls `unroll` passes (EAGLE-3's
training-time test): pass s reads at position t the prediction pass s-1 made at t-1, and
attends exactly as drafting step s+1 does (AttnPlan.prev_kv). Inputs get a little uniform
noise, as in EAGLE, for robustness to the head's own errors.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import TrainArgs
from skyline.ops.norm import rms_norm_ref
from skyline.progress import bar
from skyline.worker.spec.eagle import (
    AttnPlan,
    EagleHead,
    build_head,
    init_head,
    save_head,
    target_parts,
)

log = logging.getLogger(__name__)


class Sample(NamedTuple):
    """One training sequence: tokens, how many are prompt, and the target's features of
    positions 0..len(feats)-1 (the last token, never fed to the target, may have none)."""

    token_ids: list[int]
    num_prompt: int
    feats: torch.Tensor  # [m, hidden], m <= len(token_ids)


def draft_vocabulary(samples: list[Sample], size: int, vocab_size: int,
                     always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` token ids most frequent in the samples (and `always`), ascending."""
    counts = Counter(t for s in samples for t in s.token_ids)
    ids = [t for t in always if 0 <= t < vocab_size]
    for t, _ in counts.most_common():
        if len(ids) >= size:
            break
        if t not in ids:
            ids.append(t)
    # Pad with the lowest unused ids, so every head of this shape has `size` entries.
    t = 0
    used = set(ids)
    while len(ids) < min(size, vocab_size):
        if t not in used:
            ids.append(t)
        t += 1
    return torch.tensor(sorted(ids), dtype=torch.int64)


@dataclass
class _Batch:
    toks: torch.Tensor  # [T] x_{t+1}
    feats: torch.Tensor  # [T, H] f_t
    target: torch.Tensor  # [T, H] f_{t+1}
    positions: torch.Tensor  # [T]
    mask: torch.Tensor  # [T] bool: x_{t+2} is a continuation token
    lengths: list[int]


def _make_batch(samples: list[Sample], device: torch.device) -> _Batch:
    toks, feats, target, pos, mask, lengths = [], [], [], [], [], []
    for s in samples:
        m = s.feats.shape[0]
        n = m - 1  # head positions 0..m-2 (each needs f_t and f_{t+1})
        toks.append(torch.tensor(s.token_ids[1:m]))
        feats.append(s.feats[:n])
        target.append(s.feats[1:m])
        t = torch.arange(n)
        pos.append(t)
        mask.append(t + 2 >= s.num_prompt)
        lengths.append(n)
    return _Batch(torch.cat(toks).to(device), torch.cat(feats).to(device, torch.float32),
                  torch.cat(target).to(device, torch.float32), torch.cat(pos).to(device),
                  torch.cat(mask).to(device), lengths)


def _batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[Sample]]:
    order = list(samples)
    rng.shuffle(order)
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    n = 0
    for s in order:
        k = s.feats.shape[0] - 1
        if cur and n + k > batch_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += k
    if cur:
        out.append(cur)
    return out


class _Objective:
    """The unrolled loss of a batch, and top-1 agreement with the target per pass."""

    def __init__(self, head: EagleHead, model: nn.Module, args: TrainArgs,
                 feat_scale: float) -> None:
        self.head, self.args, self.scale = head, args, feat_scale
        self.parts = target_parts(model, head.vocab_ids, torch.float32)
        self.norm_w = self.parts.norm.weight.detach().float()
        self.eps = self.parts.norm.eps

    def __call__(self, b: _Batch, gen: torch.Generator | None
                 ) -> tuple[torch.Tensor, list[float], list[int]]:
        a = self.args
        # Only positions that predict a continuation token are scored (the LM-head matmuls
        # dominate the cost); prompt positions are context.
        rows = b.mask.nonzero().squeeze(1)  # [R]
        with torch.no_grad():
            tgt = self.parts.logits(b.target[rows])  # [R, V']
            tgt_p = tgt.softmax(-1)
            tgt_top = tgt.argmax(-1)
            emb = self.parts.embed(b.toks.to(self.parts.embed.weight.device)).float()
        feats = b.feats
        if gen is not None and a.noise > 0:
            u = torch.rand(feats.shape, generator=gen, device="cpu").to(feats.device)
            feats = feats + (u - 0.5) * 2 * a.noise * self.scale
        starts = torch.tensor([0] + b.lengths[:-1]).cumsum(0).to(feats.device)
        prev_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        loss = feats.new_zeros(())
        correct, counted = [], []
        for s in range(a.unroll):
            g = self.head(emb, feats, b.positions, AttnPlan(b.lengths, prev_kv=prev_kv))
            assert self.head.attn.last_kv is not None
            prev_kv.append(self.head.attn.last_kv)
            out = rms_norm_ref(g, self.norm_w, self.eps)  # [T, H] f'_{t+1}
            scored = out[rows]
            logits = self.parts.logits(scored)  # [R, V']
            ce = -(tgt_p * logits.log_softmax(-1)).sum(-1)  # [R]
            reg = F.smooth_l1_loss(scored / self.scale, b.target[rows] / self.scale,
                                   reduction="none").mean(-1)
            m = b.positions[rows] >= s  # pass s has no prediction to read before position s
            k = int(m.sum())
            if k:
                loss = loss + a.unroll_decay**s * ((ce + a.reg_weight * reg) * m).sum() / k
            with torch.no_grad():
                correct.append(int(((logits.argmax(-1) == tgt_top) & m).sum()))
                counted.append(k)
            # Next pass: position t reads the prediction made at t - 1 (its sequence's first
            # position keeps the target's feature).
            shifted = torch.cat([feats[:1], out[:-1]])
            shifted[starts] = feats[starts]
            feats = shifted
        return loss, [c / max(n, 1) for c, n in zip(correct, counted, strict=True)], counted


def evaluate(obj: _Objective, samples: list[Sample], device: torch.device,
             batch_tokens: int) -> dict[str, float]:
    """Mean loss and per-pass top-1 agreement with the target on `samples`."""
    obj.head.train()  # the same (reference) code path as training, without noise
    tot_loss, tot_n = 0.0, 0
    corr = [0.0] * obj.args.unroll
    cnt = [0] * obj.args.unroll
    with torch.no_grad():
        for group in _batches(samples, batch_tokens, random.Random(0)):
            loss, acc, counted = obj(_make_batch(group, device), None)
            tot_loss += float(loss) * counted[0]
            tot_n += counted[0]
            for s in range(len(acc)):
                corr[s] += acc[s] * counted[s]
                cnt[s] += counted[s]
    out = {"loss": tot_loss / max(tot_n, 1)}
    for s in range(len(corr)):
        out[f"top1_step{s + 1}"] = corr[s] / max(cnt[s], 1)
    return out


def train_head(model: nn.Module, samples: list[Sample], args: TrainArgs,
               eos_ids: tuple[int, ...] = ()) -> tuple[EagleHead, dict[str, Any]]:
    """Train a head for `model` on the recorded samples; returns it (eval mode, the model's
    dtype) and the training statistics."""
    if not samples:
        raise ValueError("no training sequences: every prompt was empty or too long")
    device = model.lm_head.weight.device
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    data = list(samples)
    rng.shuffle(data)
    num_val = min(max(1, int(len(data) * args.val_fraction)), len(data) - 1)
    val, train = data[:num_val], data[num_val:]
    if not train:
        train = val
    vocab = draft_vocabulary(train, args.draft_vocab, model.arch.vocab_size, eos_ids)
    head = build_head(model, vocab.numel(), torch.float32)
    init_head(head, model, args.seed)
    head.vocab_ids.copy_(vocab.to(head.vocab_ids.device))
    head.requires_grad_(True)
    feats = torch.cat([s.feats[:256].float() for s in train[:64]])
    scale = float(feats.pow(2).mean().sqrt()) or 1.0
    obj = _Objective(head, model, args, scale)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    per_epoch = len(_batches(train, args.batch_tokens, random.Random(0)))
    total = args.steps if args.steps is not None else args.epochs * per_epoch
    warmup = max(1, total // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    before = evaluate(obj, val, device, args.batch_tokens)
    log.info("held-out before training: %s", _fmt(before))
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    step, t0, history = 0, time.perf_counter(), []
    progress = bar(total=total, desc="training the head", unit=" steps")
    while step < total:
        for group in _batches(train, args.batch_tokens, rng):
            if step >= total:
                break
            for pg in opt.param_groups:
                pg["lr"] = lr_at(step)
            head.train()
            loss, acc, _ = obj(_make_batch(group, device), gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            history.append(loss.item())
            step += 1
            progress.update()
            progress.set_postfix_str(f"loss {sum(history[-20:]) / len(history[-20:]):.3f}")
            if step % 20 == 0 or step == total:
                log.info("step %d/%d loss %.4f top1 %s (%.0f s)", step, total,
                         sum(history[-20:]) / len(history[-20:]),
                         " ".join(f"{a:.2f}" for a in acc), time.perf_counter() - t0)
    progress.close()
    after = evaluate(obj, val, device, args.batch_tokens)
    log.info("held-out after training: %s", _fmt(after))
    head.requires_grad_(False)
    dtype = model.lm_head.weight.dtype
    for p in head.parameters():  # not head.to(): the rotary table is the target's
        p.data = p.data.to(dtype)
    head.eval()
    stats = {
        "train_args": asdict(args),
        "num_train_sequences": len(train),
        "num_val_sequences": len(val),
        "num_train_positions": sum(s.feats.shape[0] - 1 for s in train),
        "steps": step,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "first_loss": history[0] if history else None,
        "last_loss": sum(history[-10:]) / max(1, len(history[-10:])),
        "val_before": before,
        "val_after": after,
    }
    return head, stats


def _fmt(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in d.items())


def train_and_save(model: nn.Module, samples: list[Sample], args: TrainArgs,
                   eos_ids: tuple[int, ...], out_dir: str, about: dict[str, Any]
                   ) -> dict[str, Any]:
    """Train a head for `model` (train_head) and save it to `out_dir` with its training
    statistics after `about` (what the caller records of the run); returns them."""
    head, stats = train_head(model, samples, args, eos_ids)
    stats = {**about, **stats}
    save_head(out_dir, head, {"training": stats})
    return stats
