"""The EAGLE-style speculative head: one small layer on the target model's hidden states.

Position t of the head reads the target's feature f_t (its final hidden state at t, the input
of its LM head) and the embedding of the token x_{t+1} that follows, and predicts f_{t+1}:

    x = fc([embed(x_{t+1}), f_t])          # [T, 2H] -> [T, H], own weights
    g = layer(x)                           # one decoder layer of the target's architecture,
                                           # own weights, attending over the head's own
                                           # earlier positions of the request
    f'_{t+1} = norm(g)                     # the target's final norm (shared, frozen)
    logits(x_{t+2}) = lm_head(f'_{t+1})    # the target's LM head (shared, frozen), restricted
                                           # to the head's draft vocabulary

Drafting feeds f' back as the next position's feature, so one head step per draft token. The
draft vocabulary (the tokens the head may propose, the most frequent ones of its training
data) keeps the LM-head matmul of a draft step small; the target verifies every draft, so
which tokens can be drafted changes the speed only, never the output.

On disk a head is a directory: `head.safetensors` (the head's own weights and `vocab_ids`)
and `config.json` (the target shape it was trained for; `check_head` compares it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError, ModelArch
from skyline.model.layers.linear import Linear
from skyline.model.layers.mlp import MLP
from skyline.model.layers.norm import RMSNorm
from skyline.model.llama import LlamaAttention, LlamaDecoderLayer
from skyline.ops import cpu_linear
from skyline.ops.activation import silu_and_mul_ref
from skyline.ops.norm import fused_add_rms_norm_ref, rms_norm_ref
from skyline.ops.rotary import rotary_embedding_ref
from skyline.worker.spec.head_cache import HeadCache, attend_cached

HEAD_FORMAT = "skyline-eagle-head"
WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "config.json"
# The shape fields a head must share with its target.
SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_heads",
                "num_kv_heads", "head_dim")
HEADS_DIR = os.path.join(os.path.dirname(__file__), "heads")
DEFAULT_HEAD = "smollm2-135m"  # trained for the embedded default model


@dataclass
class AttnPlan:
    """What the head's attention sees in one forward: the flat batch is sequences of
    `lengths[i]` tokens. With `caches`, sequence i's k/v are written to rows `starts[i]:` of
    `caches[i]` and its queries attend causally over rows [0, starts[i] + lengths[i]). Without,
    each sequence attends causally over itself (training), and with `prev_kv` (training-time
    unrolling, pass s = len(prev_kv)) query t attends pass 0's keys j <= t - s and pass r's key
    at t - s + r for 0 < r <= s: what drafting step s + 1 sees."""

    lengths: list[int]
    caches: Sequence[HeadCache] | None = None
    starts: Sequence[int] | None = None
    prev_kv: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()


class HeadAttention(nn.Module):
    """q [T, H, D], k/v [T, KVH, D] -> [T, H * D] following `self.plan` (set by EagleHead)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.plan: AttnPlan | None = None
        self.last_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # training: this pass's

    def kv_write(self, v: torch.Tensor) -> None:
        """No cache write for the rope kernel to fuse: attend_cached writes the head's pool."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_written: bool = False) -> torch.Tensor:
        # the plain output, which every Linear takes (no rounded output for a quantized o_proj)
        plan = self.plan
        assert plan is not None, "EagleHead sets the attention plan"
        if plan.caches is not None:  # serving: the paged head cache
            assert plan.starts is not None
            self.last_kv = None
            return attend_cached(q, k, v, plan.lengths, plan.caches, plan.starts,
                                 self.scale).flatten(1, 2)
        self.last_kv = (k, v)
        out, o = [], 0
        for n in plan.lengths:
            ki, vi, mask = self._train_keys(k, v, o, n, plan.prev_kv)
            out.append(self._attend(q[o : o + n], ki, vi, mask))
            o += n
        return torch.cat(out).flatten(1, 2)

    def _train_keys(
        self, k: torch.Tensor, v: torch.Tensor, o: int, n: int,
        prev_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        s = len(prev_kv)
        if s == 0:
            t = torch.arange(n, device=k.device)
            return k[o : o + n], v[o : o + n], t[None, :] <= t[:, None]
        passes = [*prev_kv, (k, v)]
        keys = torch.cat([pk[o : o + n] for pk, _ in passes])  # [(s + 1) * n, KVH, D]
        vals = torch.cat([pv[o : o + n] for _, pv in passes])
        t = torch.arange(n, device=k.device)[:, None]  # query positions
        j = torch.arange(n, device=k.device)[None, :]  # key positions within a pass
        masks = [j <= t - s] + [j == t - s + r for r in range(1, s + 1)]
        return keys, vals, torch.cat(masks, dim=1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [heads, T, D]
            attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(0, 1)  # [T, H, D]


def _head_shape(arch: ModelArch) -> dict[str, Any]:
    return {f: getattr(arch, f) for f in SHAPE_FIELDS}


class EagleHead(nn.Module):
    """fc + one decoder layer (see the module docstring). `forward` returns g, before the
    target's final norm; the target parts (embedding, norm, LM head) are not part of it.

    In eval mode the layer runs the target's own layer code (fused kernels on CUDA); in train
    mode the same math through the ops' PyTorch references, which autograd can differentiate.
    """

    def __init__(self, arch: ModelArch, attention_cls: type[LlamaAttention],
                 rotary: nn.Module, draft_vocab_size: int) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = LlamaDecoderLayer(arch, rotary, attention_cls, 0,
                                       MLP(arch.hidden_size, arch.intermediate_size))
        a = self.layer.self_attn
        self.attn = HeadAttention(a.attn.num_heads, a.head_dim, a.head_dim**-0.5,
                                  a.attn.num_kv_heads)
        a.attn = self.attn
        # The draft vocabulary: target token ids the head may propose, ascending.
        self.register_buffer("vocab_ids", torch.zeros(draft_vocab_size, dtype=torch.int64))

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] embeddings of the next tokens x_{t+1}
        feats: torch.Tensor,  # [T, H] target (or predicted) features f_t
        positions: torch.Tensor,  # [T] int64
        plan: AttnPlan,
    ) -> torch.Tensor:  # [T, H]: g, before the final norm
        x = self.fc(torch.cat([embeds, feats], dim=-1))
        self.attn.plan = plan
        try:
            if self.training:
                return self._layer_ref(positions, x)
            out, residual = self.layer(positions, x, None)
            return out + residual
        finally:
            self.attn.plan = None

    def _layer_ref(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """LlamaDecoderLayer.forward (q/k norm included for Qwen3) via torch references."""
        layer, a = self.layer, self.layer.self_attn
        eps = layer.input_layernorm.eps
        h = rms_norm_ref(x, layer.input_layernorm.weight, eps)
        q, k, v = a.qkv_proj(h).split(a.qkv_proj.output_sizes, dim=-1)
        q = q.unflatten(-1, (-1, a.head_dim))
        k = k.unflatten(-1, (-1, a.head_dim))
        v = v.unflatten(-1, (-1, a.head_dim))
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        if q_norm is not None and k_norm is not None:
            q = rms_norm_ref(q, q_norm.weight, q_norm.eps)
            k = rms_norm_ref(k, k_norm.weight, k_norm.eps)
        q, k = rotary_embedding_ref(positions, q, k, a.rotary_emb.cos_sin_cache)
        attn_out = a.o_proj(self.attn(q, k, v))
        h, residual = fused_add_rms_norm_ref(attn_out, x, layer.post_attention_layernorm.weight,
                                             eps)
        mlp = layer.mlp
        return mlp.down_proj(silu_and_mul_ref(mlp.gate_up_proj(h))) + residual

    def own_parameters(self) -> dict[str, nn.Parameter]:
        """The head's trainable weights by name (the shared rotary table is a buffer)."""
        return dict(self.named_parameters())


@dataclass
class TargetParts:
    """What the head borrows from the target, frozen: the embedding, the final norm and the
    LM-head rows of the draft vocabulary."""

    embed: nn.Module
    norm: RMSNorm
    lm_weight: torch.Tensor  # [draft_vocab, H]
    lm_packed: torch.Tensor | None = None  # lm_weight packed for oneDNN (CPU serving)

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Normed features [n, H] -> float32 logits over the draft vocabulary [n, V']."""
        if self.lm_packed is not None and feats.dtype == self.lm_packed.dtype:
            return cpu_linear.packed_linear(feats, self.lm_packed).float()
        return F.linear(feats, self.lm_weight.to(feats.dtype)).float()


def target_parts(model: nn.Module, vocab_ids: torch.Tensor,
                 dtype: torch.dtype | None = None) -> TargetParts:
    """The frozen parts of a Llama-family target (`model.embed_tokens`, `model.norm`,
    `lm_head`), the LM head gathered to `vocab_ids` (in `dtype`, default the model's)."""
    w = model.lm_head.weight
    lm = w.index_select(0, vocab_ids.to(w.device))
    return TargetParts(model.model.embed_tokens, model.model.norm,
                       lm.to(dtype) if dtype is not None else lm)


def build_head(model: nn.Module, draft_vocab_size: int,
               dtype: torch.dtype | None = None) -> EagleHead:
    """An uninitialised head for `model` (weights empty, as layers are before loading), on the
    model's device, in `dtype` (default: the model's)."""
    ref = model.lm_head.weight
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype or ref.dtype)
    try:
        with ref.device:
            head = EagleHead(model.arch, type(model).attention_cls, model.model.rotary_emb,
                             draft_vocab_size)
    finally:
        torch.set_default_dtype(prev)
    return head


def init_head(head: EagleHead, model: nn.Module, seed: int = 0) -> None:
    """Training start: the head passes the feature through, f'_{t+1} = norm(f_t). fc is the
    identity on the feature (plus a small random embedding part) and the layer is the
    target's last decoder layer with its output projections (o_proj, down_proj) zeroed, so
    its attention and MLP start as no-ops on the residual and learn corrections."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    last = dict(model.model.layers[-1].named_parameters())
    for name, module in model.model.layers[-1].named_modules():
        if isinstance(module, Linear) and f"{name}.weight" not in last:
            full = module.full_weight()  # a weight packed for the CPU
            if full is not None:
                last[f"{name}.weight"] = full
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            src = last.get(name)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif src is not None and src.shape == p.shape and src.is_floating_point():
                p.copy_(src)
            else:  # a quantized target layer: a fresh random layer
                p.copy_(torch.ones_like(p) if p.dim() == 1 else
                        torch.randn(p.shape, generator=g).to(p) * 0.02)
        h = head.arch.hidden_size
        w = torch.randn(h, 2 * h, generator=g) * 0.02
        w[:, h:] += torch.eye(h)
        head.fc.weight.copy_(w.to(head.fc.weight))
        assert head.fc.bias is not None
        head.fc.bias.zero_()


# ---------------------------------------------------------------------------- on disk


def read_head_config(path: str) -> dict[str, Any]:
    """The head's config.json; a ConfigError naming what to do if `path` holds no head."""
    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path) or not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
        raise ConfigError(
            f"--speculative-model {path!r} is not a speculative head directory ({CONFIG_FILE} "
            f"and {WEIGHTS_FILE}); write one with `skyline train-speculator`")
    with open(cfg_path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError:
            cfg = {}
    if cfg.get("format") != HEAD_FORMAT:
        raise ConfigError(f"{cfg_path} is not a skyline speculative head config; "
                          "write one with `skyline train-speculator`")
    return cfg


def check_head(path: str, arch: ModelArch) -> dict[str, Any]:
    """Read the head's config and check that it was trained for a target of `arch`'s shape."""
    cfg = read_head_config(path)
    want = _head_shape(arch)
    for name in SHAPE_FIELDS:
        if cfg.get(name) != want[name]:
            raise ConfigError(
                f"the speculative head in {path} was trained for a model with {name} "
                f"{cfg.get(name)}, but this model has {want[name]}; train one for it with "
                "`skyline train-speculator`")
    return cfg


def save_head(path: str, head: EagleHead, info: dict[str, Any],
              dtype: torch.dtype = torch.float16) -> None:
    """Write the head's weights (in `dtype`) and config; `info` goes into the config."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {n: p.detach().to("cpu", dtype).contiguous()
               for n, p in head.own_parameters().items()}
    tensors["vocab_ids"] = head.vocab_ids.to("cpu", torch.int32).contiguous()
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    cfg = {"format": HEAD_FORMAT, "version": 1, **_head_shape(head.arch),
           "draft_vocab_size": int(head.vocab_ids.numel()), **info}
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(cfg, f, indent=2)


def load_head(path: str, model: nn.Module, dtype: torch.dtype | None = None) -> EagleHead:
    """The head in `path` for target `model`, on its device and in `dtype` (default: the
    model's), in eval mode."""
    from safetensors.torch import load_file

    cfg = check_head(path, model.arch)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    vocab_ids = tensors.pop("vocab_ids", None)
    if vocab_ids is None or vocab_ids.numel() != cfg.get("draft_vocab_size"):
        raise ConfigError(f"{path}/{WEIGHTS_FILE} has no draft vocabulary of the size its "
                          "config gives; write the head again with `skyline train-speculator`")
    if int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= model.arch.vocab_size:
        raise ConfigError(f"the draft vocabulary in {path} has token ids outside the model's "
                          "vocabulary; the head belongs to another model")
    head = build_head(model, vocab_ids.numel(), dtype)
    params = head.own_parameters()
    if set(tensors) != set(params):
        missing = sorted(set(params) - set(tensors)) or sorted(set(tensors) - set(params))
        raise ConfigError(f"{path}/{WEIGHTS_FILE} does not match the head's weights "
                          f"({', '.join(missing[:3])}); write it again with "
                          "`skyline train-speculator`")
    with torch.no_grad():
        for name, p in params.items():
            if tensors[name].shape != p.shape:
                raise ConfigError(f"{path}: weight {name} has shape "
                                  f"{tuple(tensors[name].shape)}, the head needs "
                                  f"{tuple(p.shape)}; the head belongs to another model")
            p.copy_(tensors[name])
        head.vocab_ids.copy_(vocab_ids.to(torch.int64))
    head.requires_grad_(False)
    return head.eval()


def default_head_dir() -> str | None:
    """The head shipped for the embedded default model, if this install has it."""
    path = os.path.join(HEADS_DIR, DEFAULT_HEAD)
    return path if os.path.isfile(os.path.join(path, CONFIG_FILE)) else None
