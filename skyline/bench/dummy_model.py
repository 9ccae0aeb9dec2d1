"""A model directory for dummy-weight serving benchmarks: a shipped config.json plus a synthetic
word-level tokenizer.json with the model's full vocabulary (bench/dummy_tokenizer.py).

A shipped config alone has no tokenizer, so `skyline serve` on it takes token ids only and
streams empty text: a load generator then sees no first token (no TTFT, no inter-token times)
and the server skips detokenization, which real deployments pay for. This tokenizer maps the
load generator's English words to one token each (prompts stay token-exact through /tokenize)
and decodes every id to a short word, so the streamed text, TTFT and the server's detokenizing
work are those of a real model.

    python bench/dummy_tokenizer.py --model llama-3.1-8b --out /tmp/llama-3.1-8b-dummy
    skyline serve --model /tmp/llama-3.1-8b-dummy --load-format dummy
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

from skyline.bench.workloads import _WORDS
from skyline.configs import dummy_config_dir, shipped_config_names


def build_tokenizer(vocab_size: int, bos_id: int | None, eos_ids: list[int]) -> Any:
    """A `tokenizers.Tokenizer`: whitespace-split words; id 0 is [UNK], then the workload's
    words, then fillers `t<id>`; bos/eos ids become special tokens `<|bos|>` / `<|eos_N|>`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    special = {bos_id: "<|bos|>"} if bos_id is not None else {}
    special.update({e: f"<|eos_{e}|>" for e in eos_ids})
    words = iter(dict.fromkeys(_WORDS))
    vocab: dict[str, int] = {"[UNK]": 0}
    for i in range(1, vocab_size):
        vocab[special[i] if i in special else "▁" + next(words, f"t{i}")] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(t, special=True) for t in special.values()])
    return tok


def write_model_dir(model: str, out: str) -> str:
    """Copy the shipped config `model` (a name, or a directory with config.json) to `out` and
    write the synthetic tokenizer beside it; returns `out`."""
    src = dummy_config_dir(model) or model
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        sys.exit(f"dummy_tokenizer: {model!r} is neither a shipped config "
                 f"({', '.join(shipped_config_names())}) nor a directory with config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id")
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    tok = build_tokenizer(int(cfg["vocab_size"]), cfg.get("bos_token_id"), eos_ids)
    os.makedirs(out, exist_ok=True)
    shutil.copy(cfg_path, os.path.join(out, "config.json"))
    tok.save(os.path.join(out, "tokenizer.json"))
    tc = {"eos_token": f"<|eos_{eos_ids[0]}|>" if eos_ids else None, "add_bos_token": False}
    if cfg.get("bos_token_id") is not None:
        tc["bos_token"] = "<|bos|>"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    return out


# A model whose steps cost next to nothing on any device: for measuring what is around them
# (the API process, bench/serve_ceiling.py), with real text from the synthetic tokenizer.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "vocab_size": 4096, "bos_token_id": 4094, "eos_token_id": 4095,
}


def tiny_model_dir(root: str) -> str:
    """A 1-layer, hidden-64 Llama config with a 4,096-word tokenizer, in `root`/model."""
    src = os.path.join(root, "config")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return write_model_dir(src, os.path.join(root, "model"))
