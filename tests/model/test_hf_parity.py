"""skyline models against Hugging Face transformers: tiny random-weight models of each supported
architecture, saved as safetensors, loaded by skyline's loader; logits must agree (fp32, CPU)
without a forward context, over a paged KV cache in one flattened batch, and step by step.
Sliding windows of 8 tokens (Mistral, gpt-oss) are shorter than the prompts, so the steps
attend past them."""

from __future__ import annotations

import math

import pytest
import torch

from skyline.config import ModelConfig
from skyline.model.forward_ctx import AttentionMetadata, forward_context
from skyline.model.layers.linear import Linear
from skyline.model.loader import load_model, prepack_for_cpu, read_model_arch
from skyline.ops import cpu_linear

transformers = pytest.importorskip("transformers")

VOCAB = 256
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,  # with theta 5e5 and head_dim 16 all 3 bands occur
)
GPT_OSS_ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                    beta_slow=1.0, original_max_position_embeddings=64, truncate=False)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=3)),
    "llama_tied_llama3": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2_bias_linear_rope": (
        "Qwen2Config", "Qwen2ForCausalLM", dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "qwen3_qknorm_yarn": (
        "Qwen3Config", "Qwen3ForCausalLM",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    ),
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # a dense MLP on layer 1; top-k weights not renormalized
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
             norm_topk_prob=False, mlp_only_layers=[1]),
    ),
    "mixtral_sliding_window": (
        "MixtralConfig", "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8),
    ),
    # sinks, sliding (layer 0) and full (layer 1) attention, clamped SwiGLU, biases, YaRN
    "gpt_oss": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=8,
             swiglu_limit=0.5, rope_parameters=GPT_OSS_ROPE),
    ),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def build_hf(case: str, seed: int = 0):
    config_name, model_name, extra = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**{**SMALL, **extra})
    model = getattr(transformers, model_name)(config).eval()
    # Large enough weights that attention is far from uniform (so rope and masking matter),
    # norm weights away from 1 and non-zero biases (so a skipped load shows).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def load_skyline(path: str, dtype: str = "float32"):
    arch, fmt = read_model_arch(path)
    cfg = ModelConfig(path=path, load_format=fmt, arch=arch, dtype=dtype, max_model_len=256)
    return load_model(cfg, "cpu")


# Packing changes the attention Linears and the LM head only: MoE cases other than gpt-oss's
# (biases) run dense.
LAYOUTS = [(case, layout) for case in CASES for layout in ("dense", "packed")
           if layout == "dense" or case.startswith(("llama", "mistral", "qwen2", "qwen3_qk",
                                                     "gpt_oss"))]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"{c}-{lay}" for c, lay in LAYOUTS])
def models(request, tmp_path_factory):
    """(HF model, skyline model); "packed": Linears and LM head packed for oneDNN, as the
    engine serves on the CPU."""
    case, layout = request.param
    hf = build_hf(case)
    path = tmp_path_factory.mktemp(case)
    hf.save_pretrained(path, safe_serialization=True)
    sky = load_skyline(str(path))
    if layout == "packed":
        linears = sum(isinstance(m, Linear) for m in sky.modules())
        packed = prepack_for_cpu(sky, torch.float32)
        assert packed == linears + 1 or not cpu_linear.can_pack(sky.lm_head.weight)
    return hf, sky


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]


class PagedCache:
    """KV caches bound to the model's attention layers, with blocks handed out scattered."""

    def __init__(self, model, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        arch = model.arch
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = self.free.tolist()
        self.tables: dict[str, list[int]] = {}
        for layer in model.attention_layers():
            shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
            # Large finite garbage: reading any slot this test did not write spoils the logits.
            # (Not NaN: the reference decode path reads masked padding, where 0 * NaN = NaN.)
            layer.kv_cache = torch.randn(shape) * 100

    def unbind(self) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = None

    def step(self, chunks: list[tuple[str, list[int], int]]):
        """chunks: (seq id, new token ids, tokens already cached); decodes first.
        Returns flattened (input_ids, positions, metadata)."""
        ids, positions, slots, loc, seq_lens, tables = [], [], [], [0], [], []
        num_decodes = 0
        for seq, new_ids, start in chunks:
            end = start + len(new_ids)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            pos = list(range(start, end))
            ids += new_ids
            positions += pos
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in pos]
            loc.append(loc[-1] + len(new_ids))
            seq_lens.append(end)
            tables.append(table)
            num_decodes += len(new_ids) == 1 and num_decodes == len(seq_lens) - 1
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                    dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=self.block_size,
            num_decodes=num_decodes,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        )
        return torch.tensor(ids), torch.tensor(positions), meta


def run_step(model, cache: PagedCache, chunks):
    ids, positions, meta = cache.step(chunks)
    with torch.no_grad(), forward_context(meta):
        logits = model.compute_logits(model(ids, positions))
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), VOCAB)
    return logits, meta.query_start_loc


def test_no_context_matches_hf(models):
    hf, sky = models
    ids = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        hidden = sky(torch.tensor(ids), torch.arange(len(ids)))
        logits = sky.compute_logits(hidden)
    assert hidden.shape == (len(ids), sky.arch.hidden_size)
    assert rel_err(logits, hf_logits(hf, ids)) < 1e-4


def test_paged_batch_of_two_sequences(models):
    hf, sky = models
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, VOCAB, (21,), generator=g).tolist()
    b = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    cache = PagedCache(sky, block_size=4, num_blocks=16)
    try:
        logits, loc = run_step(sky, cache, [("a", a, 0), ("b", b, 0)])
    finally:
        cache.unbind()
    assert rel_err(logits[loc[0]:loc[1]], hf_logits(hf, a)) < 1e-4
    assert rel_err(logits[loc[1]:loc[2]], hf_logits(hf, b)) < 1e-4


def test_incremental_prefill_extend_decode(models):
    """Chunked prefill, a prefix-extend mixed with a decode, then batched decodes of two
    sequences of different lengths; every step's logits against HF's full-sequence logits."""
    hf, sky = models
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, VOCAB, (15,), generator=g).tolist()
    b = torch.randint(0, VOCAB, (13,), generator=g).tolist()
    ref = {"a": hf_logits(hf, a), "b": hf_logits(hf, b)}
    full = {"a": a, "b": b}
    steps = [
        [("a", a[0:6], 0)],  # prefill, first chunk
        [("a", a[6:9], 6), ("b", b[0:5], 0)],  # prefix-extend + fresh prefill
        [("a", a[9:10], 9), ("b", b[5:8], 5)],  # one decode + one extend
        [("a", a[10:11], 10)],  # single decode
    ]
    steps += [[("a", a[i:i + 1], i), ("b", b[i - 3:i - 2], i - 3)] for i in range(11, 15)]
    steps += [[("b", b[12:13], 12)]]
    cache = PagedCache(sky, block_size=4, num_blocks=12, seed=5)
    try:
        for chunks in steps:
            logits, loc = run_step(sky, cache, chunks)
            for i, (seq, new_ids, start) in enumerate(chunks):
                assert full[seq][start:start + len(new_ids)] == new_ids
                want = ref[seq][start:start + len(new_ids)]
                assert rel_err(logits[loc[i]:loc[i + 1]], want) < 1e-4, (seq, start)
    finally:
        cache.unbind()


def greedy_matches_hf(hf, sky, prompt: list[int], new_tokens: int, block_size: int) -> None:
    """Greedy tokens step by step over a paged cache equal HF generate's."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    want = out[0, len(prompt):].tolist()
    cache = PagedCache(sky, block_size=block_size, num_blocks=16)
    got, n = [], len(prompt)
    try:
        logits, _ = run_step(sky, cache, [("s", prompt, 0)])
        for _ in range(new_tokens):
            got.append(int(logits[-1].argmax()))
            logits, _ = run_step(sky, cache, [("s", got[-1:], n)])
            n += 1
    finally:
        cache.unbind()
    assert got == want


def test_greedy_continuation_matches_hf(models):
    hf, sky = models
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    greedy_matches_hf(hf, sky, prompt, 8, block_size=2)


def test_bfloat16_load_is_close(models, tmp_path):
    hf, _ = models
    hf.save_pretrained(tmp_path, safe_serialization=True)
    sky = load_skyline(str(tmp_path), dtype="bfloat16")
    assert torch.get_default_dtype() == torch.float32  # restored after building
    assert sky.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = list(range(3, 40, 3))
    with torch.no_grad():
        logits = sky.compute_logits(sky(torch.tensor(ids), torch.arange(len(ids))))
    assert logits.dtype == torch.float32
    assert math.isfinite(logits.sum().item())
    # An MoE's routing is discontinuous: bf16 rounding can swap a token's expert.
    assert rel_err(logits, hf_logits(hf, ids)) < (0.15 if sky.arch.num_experts else 5e-2)
