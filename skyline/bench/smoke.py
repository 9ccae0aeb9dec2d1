"""What the bench scripts' --smoke modes share: the tiny random model they run the engine on,
and the device of a GPU benchmark (the CPU when a smoke run has no GPU). A smoke run executes
a script's code paths in seconds; none of its figures mean anything."""

from __future__ import annotations

import json
import os
import tempfile

import torch

from skyline.bench.dummy_model import build_tokenizer

# A Llama small enough that an engine loads it (random weights) and runs a step in
# milliseconds on a CPU: every code path of a benchmark in seconds, none of its figures.
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
               "max_position_embeddings": 4096, "torch_dtype": "float32",
               "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                      "{% if add_generation_prompt %}assistant {% endif %}")


def tiny_model(out: str | None = None) -> str:
    """A directory holding TINY_CONFIG (load it with load_format "dummy"), a word-level
    tokenizer and a chat template: the model of the bench scripts' --smoke runs."""
    out = out or tempfile.mkdtemp(prefix="skyline-tiny-")
    tok = build_tokenizer(TINY_CONFIG["vocab_size"], TINY_CONFIG["bos_token_id"],
                          [TINY_CONFIG["eos_token_id"]])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(TINY_CONFIG, f)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos_2|>", "add_bos_token": False,
                   "chat_template": TINY_CHAT_TEMPLATE}, f)
    return out


def bench_device(script: str, smoke: bool) -> str:
    """"cuda" for a GPU benchmark; with `smoke` and no GPU, "cpu". Exits with one sentence
    when a real run has no GPU."""
    if torch.cuda.is_available():
        return "cuda"
    if not smoke:
        raise SystemExit(f"{script} measures a GPU; run it on the GPU machine (or --smoke)")
    return "cpu"
