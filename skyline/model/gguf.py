"""GGUF model files: metadata -> a HF-style config.json dict, tensors -> HF-named float32
weights (dequantized by ops/dequant.py).

llama.cpp's converter permutes the rows of Q and K of llama-architecture models so that rope
rotates interleaved pairs; `iter_gguf_weights` undoes that, so the weights drop into the same
rotate-half model code as safetensors checkpoints. qwen2/qwen3 files are not permuted.

Mixture-of-experts files (qwen3moe; Mixtral, which llama.cpp files as llama with experts) store
each layer's experts stacked, `ffn_{gate,up,down}_exps` [E, rows, cols]; they come out per
expert under HF's names, as a safetensors checkpoint has them.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from skyline.config import ConfigError, ModelArch
from skyline.model.gguf_rope import f32, rope_scaling_from_gguf
from skyline.ops.dequant import GGML_TYPES, SUPPORTED_TYPE_NAMES, dequantize_ref

# GGUF general.architecture -> (HF architecture, HF model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),  # Mistral files say llama too
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
MOE_LLAMA = ("MixtralForCausalLM", "mixtral")  # a llama file with experts
PERMUTED_QK = {"llama"}  # architectures whose Q/K rows llama.cpp permuted

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the router
}
# stacked experts [E, rows, cols] -> per-expert projections
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SKIPPED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")  # not weights


def open_gguf(path: str) -> GGUFReader:
    """A GGUFReader over `path` (memory-mapped; cached while the file is unchanged)."""
    try:
        st = os.stat(path)
    except OSError:
        raise ConfigError(f"model file {path} does not exist; pass a .gguf file") from None
    if not os.path.isfile(path):
        raise ConfigError(f"{path} is not a file; pass the path of a .gguf file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    if magic != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file; pass a .gguf model or a HF model directory")
    return _open_cached(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFReader:
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error, OSError, UnicodeDecodeError,
            OverflowError) as e:
        raise ConfigError(
            f"{path} is truncated or corrupt ({e}); download or convert it again"
        ) from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ConfigError(
                f"{path} is truncated (tensor {t.name} ends past the end of the file); "
                "download it again"
            )
    return reader


# ggml types of 2 to 6 bits a weight: a head stored so is held in 6-bit codes on a CPU
_SIX_BITS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def head_code_bits(path: str) -> int:
    """The codes a CPU engine holds the LM head in for the integer dot kernel
    (LMHead.code_bits): 6 where the file stores its head (output.weight, else the tied token
    embedding) in 6 bits or fewer, else 8."""
    types = {t.name: int(t.tensor_type) for t in open_gguf(path).tensors}
    qtype = types.get("output.weight", types.get("token_embd.weight"))
    return 6 if qtype is not None and type_name(qtype) in _SIX_BITS else 8


def type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"ggml type {int(qtype)}"


def gguf_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The metadata value under `key` as plain Python (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return default if value is None else value


def _single(value: Any, key: str, path: str) -> Any:
    if isinstance(value, list):  # per-layer values; supported models have one for all layers
        if not value or any(v != value[0] for v in value):
            raise ConfigError(f"{path} has per-layer values of {key}; skyline cannot load it")
        return value[0]
    return value


def read_gguf_hf_config(path: str) -> dict[str, Any]:
    """The HF config.json equivalent of a GGUF file's metadata (llama, qwen2, qwen3)."""
    r = open_gguf(path)
    arch = gguf_value(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{path} is a GGUF of architecture {arch!r}, which skyline does not support; "
            f"use a GGUF of one of: {', '.join(ARCHITECTURES)}"
        )
    num_experts = int(gguf_value(r, f"{arch}.expert_count", 0) or 0)
    if any(re.match(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$", t.name) for t in r.tensors):
        raise ConfigError(f"{path} stores its experts one tensor each (an old converter); "
                          "convert the model again with llama.cpp's convert_hf_to_gguf.py")
    bad = sorted({type_name(q) for q in {int(t.tensor_type) for t in r.tensors} - set(GGML_TYPES)})
    if bad:
        raise ConfigError(
            f"{path} holds tensors of type {', '.join(bad)}, which skyline cannot dequantize; "
            f"use a GGUF quantized with {', '.join(SUPPORTED_TYPE_NAMES)}"
        )

    def need(key: str) -> Any:
        value = gguf_value(r, f"{arch}.{key}")
        if value is None:
            raise ConfigError(f"{path} lacks the metadata key {arch}.{key}; convert it again")
        return _single(value, key, path)

    tensors = {t.name: t for t in r.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_single(gguf_value(r, f"{arch}.attention.head_count_kv", heads), "kv", path))
    head_dim = gguf_value(r, f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":  # llama rotates the whole head
        head_dim = gguf_value(r, f"{arch}.rope.dimension_count")
    head_dim = int(head_dim or hidden // heads)
    vocab = gguf_value(r, f"{arch}.vocab_size")
    if vocab is None and "token_embd.weight" in tensors:
        vocab = tensors["token_embd.weight"].data.shape[0]
    if vocab is None:
        vocab = len(gguf_value(r, "tokenizer.ggml.tokens", []))
    theta = f32(gguf_value(r, f"{arch}.rope.freq_base", 10000.0))
    context = int(gguf_value(r, f"{arch}.context_length", 4096))
    rope_freqs = tensors.get("rope_freqs.weight")  # Llama 3.1+: llama3 scaling as a tensor
    if rope_freqs is not None:
        rope_freqs = np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1)
    eos = [gguf_value(r, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    hf_arch, model_type = MOE_LLAMA if arch == "llama" and num_experts else ARCHITECTURES[arch]
    moe: dict[str, Any] = {}
    if num_experts:
        moe = {"num_experts": num_experts,
               "num_experts_per_tok": int(need("expert_used_count")),
               "moe_intermediate_size": int(gguf_value(r, f"{arch}.expert_feed_forward_length")
                                            or need("feed_forward_length")),
               # llama.cpp renormalizes the chosen experts' weights of both architectures
               "norm_topk_prob": bool(gguf_value(r, f"{arch}.expert_weights_norm", True))}
    ffn = gguf_value(r, f"{arch}.feed_forward_length")
    if ffn is None:  # an MoE file may give the experts' size only
        ffn = moe.get("moe_intermediate_size") or need("feed_forward_length")
    return moe | {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_single(ffn, "feed_forward_length", path)),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": f32(gguf_value(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": rope_scaling_from_gguf(
            lambda key: gguf_value(r, f"{arch}.{key}"), path, theta, head_dim, rope_freqs),
        "max_position_embeddings": context,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": gguf_value(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": _weights_dtype(tensors),
    }


def _weights_dtype(tensors: dict[str, Any]) -> str:
    """The checkpoint dtype a file's matrices make it: "bfloat16" where every layer's matrix is
    BF16 (a CPU without bfloat16 units then serves it in bfloat16 on skyline's kernels:
    engine/create/resolve.py), else "float32" (quantized blocks dequantize to it exactly)."""
    types = {int(t.tensor_type) for name, t in tensors.items()
             if name.startswith("blk.") and len(t.shape) >= 2}
    return "bfloat16" if types == {int(GGMLQuantizationType.BF16)} else "float32"


def hf_weight_name(gguf_name: str) -> str | None:
    """The HF parameter name of a GGUF tensor; None for tensors that are not weights."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if _SKIPPED.match(gguf_name):
        return None
    m = _LAYER_RE.match(gguf_name)
    if m is not None and m.group(2) in _EXPERT_NAMES:  # one name per expert: "{e}" to fill
        return f"model.layers.{m.group(1)}.mlp.experts.{{e}}.{_EXPERT_NAMES[m.group(2)]}.weight"
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ConfigError(
            f"the GGUF has a tensor {gguf_name!r} that skyline does not know; "
            "is it a llama, qwen2, qwen3 or qwen3moe model?"
        )
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half pairs per head)."""
    # w: [num_heads * head_dim, hidden] or [num_heads * head_dim]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def iter_gguf_weights(
    path: str, arch: ModelArch, packed: bool = False, want: Callable[[str], Any] | None = None
) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 CPU tensor shaped as HF has it) for every weight of the GGUF file
    (that `want` is true of); one tensor in memory at a time (a layer's stacked experts: one
    expert at a time, from one dequantized tensor). A tied model yields no lm_head.weight. With
    `packed`, Linear and expert weights (`*_proj.weight`) come as stored, as
    quant.gguf.PackedGGUF raw blocks (an expert's: a view of its rows of the layer's tensor,
    in the file's memory map)."""
    r = open_gguf(path)
    gguf_arch = gguf_value(r, "general.architecture")
    permuted = gguf_arch in PERMUTED_QK
    for t in r.tensors:
        name = hf_weight_name(t.name)
        if name is None or (want is not None and not want(name)):
            continue
        if int(t.tensor_type) not in GGML_TYPES:
            raise ConfigError(
                f"tensor {t.name} of {path} is {type_name(t.tensor_type)}, which skyline cannot "
                f"dequantize; use a GGUF quantized with {', '.join(SUPPORTED_TYPE_NAMES)}"
            )
        with warnings.catch_warnings():  # the memory map is read-only; it is only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(t.data)
        experts = "{e}" in name
        keep = packed and name.endswith("_proj.weight")
        # [(E,) rows, bytes] as stored (row permutation below works on it alike), or [rows, cols]
        w = raw.contiguous().view(torch.uint8) if keep else dequantize_ref(raw, t.tensor_type)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, arch.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, arch.num_kv_heads)
        # a layer's stacked experts [E, rows, ...]: one tensor each
        pieces = [(name.format(e=e), w[e]) for e in range(w.shape[0])] if experts else [(name, w)]
        if keep:
            from skyline.quant.gguf import PackedGGUF

            _, block, size = GGML_TYPES[int(t.tensor_type)]
            cols = w.shape[-1] // size * block
            pieces = [(n, PackedGGUF(p, int(t.tensor_type), cols)) for n, p in pieces]
        yield from pieces
