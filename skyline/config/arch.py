"""What a model is, read from its config.json: `ModelArch`; and `ConfigError`, the one
exception every configuration check raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A setting or a model file the user can fix; the message says how."""


@dataclass(frozen=True)
class ModelArch:
    """Architecture hyper-parameters, from a HF config.json or GGUF metadata."""

    architecture: str  # HF name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # Sliding-window attention, per layer: a query sees the keys less than this many positions
    # before it (itself included); 0 sees its whole context. Empty: every layer full.
    sliding_windows: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense model): each token runs num_experts_per_tok of
    # num_experts gated MLPs of moe_intermediate_size in every layer but `dense_layers`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of intermediate_size
    swiglu_limit: float | None = None  # gpt-oss: the clamp of its gated activation

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (0: full attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_linears(self) -> dict[str, tuple[int, int]]:
        """{name: (N, K)} of the dense products of a decoder layer: qkv and o; a
        mixture-of-experts model's router, and the dense MLP (gate_up, down) where some layer
        has one (experts run their own kernels)."""
        h, q = self.hidden_size, self.num_heads * self.head_dim
        out = {"qkv": (q + 2 * self.num_kv_heads * self.head_dim, h), "o": (h, q)}
        if self.num_experts:
            out["router"] = (self.num_experts, h)
        if not self.num_experts or self.dense_layers:
            out.update(gate_up=(2 * self.intermediate_size, h), down=(h, self.intermediate_size))
        return out

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' field; is this a HF model?")
        arch = archs[0]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qk_norm = arch.startswith("Qwen3")
        bias = cfg.get("attention_bias", arch.startswith("Qwen2"))
        num_layers = cfg["num_hidden_layers"]
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
        if num_experts and not 0 < top_k <= num_experts:
            raise ConfigError(f"config.json routes each token to {top_k} of {num_experts} "
                              "experts; num_experts_per_tok must be between 1 and that")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            qk_norm=qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_windows=_sliding_windows(cfg, arch, num_layers),
            num_experts=num_experts,
            num_experts_per_tok=top_k if num_experts else 0,
            moe_intermediate_size=int(cfg.get("moe_intermediate_size")
                                      or (cfg["intermediate_size"] if num_experts else 0)),
            # Mixtral always renormalizes; gpt-oss's softmax over the chosen logits sums to 1
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=_dense_layers(cfg, num_layers) if num_experts else (),
            swiglu_limit=cfg.get("swiglu_limit"),
        )


def _sliding_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int, ...]:
    """Per-layer windows as transformers applies them: `layer_types` where given (gpt-oss,
    configs saved by transformers 5); else Qwen's `use_sliding_window` (the layers from
    `max_window_layers` on; every layer of Qwen3-MoE); else `sliding_window` on every layer
    (Mistral, Mixtral)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not window:
        return ()
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json has sliding_window {window!r}; it must be a positive "
                          "number of tokens or null")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError("config.json's layer_types must list one type per layer")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ConfigError(f"config.json has layer types {sorted(unknown)}, which skyline "
                              "does not support (only sliding_attention and full_attention)")
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif "use_sliding_window" in cfg:
        if not cfg["use_sliding_window"]:
            return ()
        first = 0 if arch.startswith("Qwen3Moe") else int(cfg.get("max_window_layers", 0))
        windows = tuple(window if i >= first else 0 for i in range(num_layers))
    else:
        windows = (window,) * num_layers
    return windows if any(windows) else ()


def _dense_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers of an MoE model with a dense MLP: Qwen3-MoE's `mlp_only_layers`, and those not on
    its `decoder_sparse_step`."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
