"""Llama and its close relatives: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM
(Qwen2 differs only by bias on q/k/v; Mistral's sliding window, and Qwen2's where it is on, come
from ModelArch.sliding_windows). Parameter names mirror HF's, except that q/k/v and gate/up are
stacked into `qkv_proj` and `gate_up_proj`, and MoE experts into `experts.w13` / `experts.w2`
(layers/moe.py). Subclasses change the attention (`attention_cls`), the MLP of a layer
(`make_mlp`) and checkpoint names (`renames`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from skyline.config import ConfigError, ModelArch
from skyline.model.forward_ctx import get_forward_context
from skyline.model.layers import cpu_decode
from skyline.model.layers.attention import Attention
from skyline.model.layers.embedding import LMHead, VocabEmbedding
from skyline.model.layers.linear import AttentionOutLinear, QKVLinear, default_weight_loader
from skyline.model.layers.mlp import MLP
from skyline.model.layers.moe import MoE, expert_hf_name, expert_param
from skyline.model.layers.norm import RMSNorm
from skyline.model.layers.rotary import RotaryEmbedding
from skyline.model.layers.stage import SkipLayer
from skyline.ops.kv_write import KVWrite


class LlamaAttention(nn.Module):
    sinks = False  # gpt-oss: a learned sink logit per head (layers/attention.py)
    # Qwen3: position_qk RMS-norms each head of q and k (q_norm, k_norm) before rope, with
    # rms_norm_cpu on a CPU, as layers/cpu_decode.py does
    qk_norm = False

    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        num_heads, num_kv_heads = arch.num_heads, arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVLinear(
            arch.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=arch.attention_bias,
        )
        # HF Llama puts attention_bias on o_proj too; Qwen2 biases q/k/v only.
        o_bias = arch.attention_bias and not arch.architecture.startswith("Qwen2")
        self.o_proj = AttentionOutLinear(num_heads, num_kv_heads, self.head_dim,
                                         arch.hidden_size, bias=o_bias)
        self.rotary_emb = rotary
        self.attn = Attention(num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads,
                              feeds=self.o_proj, sliding_window=arch.window(layer),
                              sinks=self.sinks)

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    kv: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q and k made ready for attention: rotated by their positions (Qwen3 norms
        them first); with `kv`, k and kv.v stored in the KV cache by the same kernel."""
        return self.rotary_emb(positions, q, k, kv)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        # this rank's heads (all of them without tensor parallelism)
        q = q.unflatten(-1, (-1, self.head_dim))  # [T, num_heads, head_dim]
        k = k.unflatten(-1, (-1, self.head_dim))  # [T, num_kv_heads, head_dim]
        v = v.unflatten(-1, (-1, self.head_dim))
        kv = self.attn.kv_write(v)
        q, k = self.position_qk(positions, q, k, kv)
        return self.o_proj(self.attn(q, k, v, kv_written=kv is not None))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding,
                 attention_cls: type[LlamaAttention], layer: int, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention_cls(arch, rotary, layer)
        self.mlp = mlp  # MLP, or an MoE block
        # Each norm hands the Linear it feeds its input quantized as that Linear takes it.
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps,
                                       feeds=self.self_attn.qkv_proj)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps,
                                                feeds=self.mlp)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of each sublayer is fused into the norm that follows it.
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, attention_cls: type[LlamaAttention],
                 make_mlp: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, self.rotary_emb, attention_cls, i, make_mlp(arch, i))
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # layers/cpu_decode.py's plan, made at the first CPU forward (False: none qualifies)
        self._cpu_decode: cpu_decode.DecodePlan | bool | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        meta = get_forward_context()
        fast = self._cpu_decode_plan() if x.device.type == "cpu" and meta is not None else None
        if fast is not None and cpu_decode.usable(fast, x, meta):
            x, residual = cpu_decode.run(fast, positions, x, meta)
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def cpu_decode_step(self) -> str:
        """How a CPU decode step runs this model's layers: "native" (the C++ step), "python"
        (the plan's products called from Python) or "modules" (each module's forward)."""
        plan = self._cpu_decode_plan()
        return "modules" if plan is None else "native" if plan.native is not None else "python"

    def forget_cpu_decode_plan(self) -> None:
        """Plan again at the next CPU forward: the layers' serving layout changed
        (loader.plain_layout), and the plan holds the old one's products."""
        self._cpu_decode = None

    def _cpu_decode_plan(self) -> cpu_decode.DecodePlan | None:
        if self._cpu_decode is None:
            # a pipeline stage's own layers (the others are SkipLayers, which pass x on)
            own = [layer for layer in self.layers if not isinstance(layer, SkipLayer)]
            plain = own and all(
                type(layer) is LlamaDecoderLayer and type(layer.mlp) in (MLP, MoE)
                and (type(layer.self_attn) is LlamaAttention
                     or (layer.self_attn.qk_norm and not layer.self_attn.sinks))
                for layer in own)
            self._cpu_decode = (plain and cpu_decode.plan(own, self.rotary_emb)) or False
        return self._cpu_decode or None


class LlamaForCausalLM(nn.Module):
    """Decoder-only causal LM over flattened tokens; see the module docstring for names."""

    attention_cls: type[LlamaAttention] = LlamaAttention
    # HF projection name -> (stacked parameter name, shard id in it)
    stacked_params: dict[str, tuple[str, Any]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # (pattern, replacement) applied to checkpoint names first, in order: an architecture's
    # own names brought to the shared ones
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, self.attention_cls, self.make_mlp)
        tie_to = self.model.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = LMHead(arch.vocab_size, arch.hidden_size, tie_to=tie_to)

    @staticmethod
    def make_mlp(arch: ModelArch, layer: int) -> nn.Module:
        """The MLP of `layer` (MoE models: a sparse block where ModelArch.is_moe_layer)."""
        return MLP(arch.hidden_size, arch.intermediate_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden [num_tokens, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size]."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """The Attention modules in layer order (the runner binds a KV cache to each)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; every parameter must be covered."""
        arch_name = self.arch.architecture
        params = dict(self.named_parameters())  # a tied lm_head appears once, as the embedding
        loaded: set[tuple[str, Any]] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if self.lm_head.tied and hf_name == "lm_head.weight":
                continue  # some tied checkpoints store the head anyway
            name, shard_id = self._param_name(hf_name)
            param = params.get(name)
            if param is None:
                raise ConfigError(
                    f"the checkpoint has a weight {hf_name!r} that {arch_name} does not use; "
                    "check that config.json belongs to this checkpoint"
                )
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ConfigError as e:
                raise ConfigError(f"checkpoint weight {hf_name!r}: {e}") from None
            loaded.add((name, shard_id))
        missing = [
            self._hf_name(name, shard_id)
            for name, param in params.items()
            for shard_id in getattr(param, "shard_ids", (None,))
            if (name, shard_id) not in loaded
        ]
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise ConfigError(
                f"the checkpoint lacks {len(missing)} weight(s) that {arch_name} needs "
                f"({shown}); it is incomplete or made for another architecture"
            )

    def _param_name(self, hf_name: str) -> tuple[str, Any]:
        for pattern, replacement in self.renames:
            hf_name = re.sub(pattern, replacement, hf_name)
        expert = expert_param(hf_name)
        if expert is not None:
            return expert
        for part, (stacked, shard_id) in self.stacked_params.items():
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{stacked}."), shard_id
        return hf_name, None

    def _hf_name(self, name: str, shard_id: Any) -> str:
        expert = expert_hf_name(name, shard_id)
        if expert is not None:
            return expert
        for part, (stacked, sid) in self.stacked_params.items():
            if shard_id is not None and sid == shard_id and f".{stacked}." in name:
                return name.replace(f".{stacked}.", f".{part}.")
        return name
