"""GGUF files of random weights for benchmarks against llama.cpp, written as llama.cpp's
converter writes them, tensor by tensor (a file of several GB never sits in memory whole):

- a Qwen3-MoE model (llama.cpp's `qwen3moe`) of a given shape with the tokenizer of another GGUF
  file (the embedded default's), for the CPU. `llama-quantize` makes its Q4_K_M from the F16
  file; without llama.cpp, the experts can be written in a type gguf-py quantizes (Q4_1, Q8_0:
  the smoke run's);
- a dense Llama model (`llama`) in BF16 or F16 with a synthetic SentencePiece vocabulary of the
  model's size (no tokenizer file needed: benchmarks feed token ids), for a GPU beside its host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize


@dataclass(frozen=True)
class MoeShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_intermediate: int


@dataclass(frozen=True)
class DenseShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


# Qwen3-30B-A3B's layer (hidden 2048, 128 experts of 768, top 8, 32 / 4 heads of 128) in 6
# layers instead of 48: 3.6 B expert weights, ~2 GB in Q4_K_M
QWEN3_30B_A3B_LAYERS = MoeShape(6, 2048, 32, 4, 128, 128, 8, 768)
TINY = MoeShape(2, 64, 4, 2, 16, 4, 2, 32)
LLAMA_3_1_8B = DenseShape(32, 4096, 32, 8, 128, 14336, 128256)  # 16.1 GB in BF16
TINY_DENSE = DenseShape(4, 64, 4, 2, 16, 128, 512)

# tokenizer.ggml.<key> -> the GGUFWriter method that writes it
_TOKENIZER = {"model": "add_tokenizer_model", "pre": "add_tokenizer_pre",
              "tokens": "add_token_list", "token_type": "add_token_types",
              "merges": "add_token_merges", "bos_token_id": "add_bos_token_id",
              "eos_token_id": "add_eos_token_id", "unknown_token_id": "add_unk_token_id",
              "padding_token_id": "add_pad_token_id", "add_bos_token": "add_add_bos_token",
              "add_space_prefix": "add_add_space_prefix"}


def write_moe_gguf(path: str, shape: MoeShape, tokenizer_from: str,
                   expert_type: GGMLQuantizationType = GGMLQuantizationType.F16,
                   seed: int = 0) -> None:
    """Write the model to `path`: weights normal(0, 0.02) (norms 1), F16 but for the experts
    in `expert_type` (F16 or a type gguf-py quantizes), the vocabulary of `tokenizer_from`."""
    fields = GGUFReader(tokenizer_from).fields
    tok = {k: f.contents() for k in _TOKENIZER
           if (f := fields.get(f"tokenizer.ggml.{k}")) is not None}
    s = shape
    w = GGUFWriter(path, "qwen3moe")
    w.add_name("qwen3moe-dummy")
    _header(w, s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim,
            s.expert_intermediate * s.top_k, rope_base=1e6, eps=1e-6)
    w.add_expert_feed_forward_length(s.expert_intermediate)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    for key, value in tok.items():
        if value not in ("", []):
            getattr(w, _TOKENIZER[key])(value)
    tensors = [(name, dims, _type(name, dims, expert_type))
               for name, dims in _moe_tensors(s, len(tok["tokens"]))]
    _write_tensors(w, tensors, seed)


def write_dense_gguf(path: str, shape: DenseShape,
                     weight_type: GGMLQuantizationType = GGMLQuantizationType.BF16,
                     seed: int = 0) -> None:
    """Write a Llama model to `path`: every matrix in `weight_type` (BF16 or F16: values of
    magnitude 1/128 to 1/64, random signs; norms 1), a SentencePiece vocabulary of
    `shape.vocab` tokens (unknown, BOS, EOS, the 256 byte pieces, then "▁t<i>")."""
    s = shape
    w = GGUFWriter(path, "llama")
    w.add_name("llama-dummy")
    _header(w, s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate,
            rope_base=5e5, eps=1e-5)
    w.add_rope_dimension_count(s.head_dim)
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [f"▁t{i}" for i in range(s.vocab - len(pieces))]
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(s.vocab - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (s.vocab - 259))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tensors = [(name, dims, GGMLQuantizationType.F32 if len(dims) == 1 else weight_type)
               for name, dims in _dense_tensors(s)]
    _write_tensors(w, tensors, seed)


def _header(w: GGUFWriter, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
            ffn: int, rope_base: float, eps: float) -> None:
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(eps)


def _write_tensors(w: GGUFWriter, tensors: list[tuple[str, tuple[int, ...],
                                                      GGMLQuantizationType]], seed: int) -> None:
    for name, dims, qtype in tensors:
        block, size = GGML_QUANT_SIZES[qtype]
        dtype = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.BF16: np.uint16,
                 GGMLQuantizationType.F32: np.float32}.get(qtype, np.uint8)
        stored = dims if dtype is not np.uint8 else (*dims[:-1], dims[-1] // block * size)
        w.add_tensor_info(name, stored, dtype, int(np.prod(dims)) // block * size,
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, dims, qtype in tensors:
        w.write_tensor_data(_values(rng, dims, qtype))
    w.close()


def _type(name: str, dims: tuple[int, ...], experts: GGMLQuantizationType
          ) -> GGMLQuantizationType:
    if "_exps" in name:
        return experts
    return GGMLQuantizationType.F32 if len(dims) == 1 else GGMLQuantizationType.F16


def _attention(b: str, hidden: int, q: int, kv: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(b + "attn_norm.weight", (hidden,)), (b + "attn_q.weight", (q, hidden)),
            (b + "attn_k.weight", (kv, hidden)), (b + "attn_v.weight", (kv, hidden)),
            (b + "attn_output.weight", (hidden, q))]


def _moe_tensors(s: MoeShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor, in file order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += _attention(b, s.hidden, q, kv)
        out += [(b + "attn_q_norm.weight", (s.head_dim,)),
                (b + "attn_k_norm.weight", (s.head_dim,)),
                (b + "ffn_norm.weight", (s.hidden,)),
                (b + "ffn_gate_inp.weight", (s.experts, s.hidden)),
                (b + "ffn_gate_exps.weight", (s.experts, s.expert_intermediate, s.hidden)),
                (b + "ffn_up_exps.weight", (s.experts, s.expert_intermediate, s.hidden)),
                (b + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_intermediate))]
    return out + [("output_norm.weight", (s.hidden,)), ("output.weight", (vocab, s.hidden))]


def _dense_tensors(s: DenseShape) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += _attention(b, s.hidden, q, kv)
        out += [(b + "ffn_norm.weight", (s.hidden,)),
                (b + "ffn_gate.weight", (s.intermediate, s.hidden)),
                (b + "ffn_up.weight", (s.intermediate, s.hidden)),
                (b + "ffn_down.weight", (s.hidden, s.intermediate))]
    return out + [("output_norm.weight", (s.hidden,)), ("output.weight", (s.vocab, s.hidden))]


def _values(rng: np.random.Generator, dims: tuple[int, ...],
            qtype: GGMLQuantizationType) -> np.ndarray:
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    if qtype == GGMLQuantizationType.BF16:
        # random sign and mantissa, exponent 2^-7: drawn as bits, 16 GB in seconds
        bits = rng.integers(0, 1 << 16, size=dims, dtype=np.uint16)
        return (bits & np.uint16(0x807F)) | np.uint16(0x3C00)
    a = rng.standard_normal(dims, dtype=np.float32) * 0.02
    if qtype == GGMLQuantizationType.F16:
        return a.astype(np.float16)
    return quantize(a, qtype)
