"""A model directory for dummy-weight serving benchmarks: a shipped config.json plus a synthetic
word-level tokenizer.json with the model's full vocabulary (skyline/bench/dummy_model.py).

    python bench/dummy_tokenizer.py --model llama-3.1-8b --out /tmp/llama-3.1-8b-dummy
    skyline serve --model /tmp/llama-3.1-8b-dummy --load-format dummy
    python bench/dummy_tokenizer.py --smoke   # into a temporary directory

With --weights DTYPE it also writes random weights in that dtype (Hugging Face transformers,
seed 0, model.safetensors), a checkpoint loaded as a user's would be:

    python bench/dummy_tokenizer.py --model DIR --weights bfloat16 --out /tmp/model-bf16
"""

from __future__ import annotations

import argparse
import tempfile

from skyline.bench.dummy_model import write_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="shipped config name or directory")
    ap.add_argument("--out", default=None, help="directory to write (required)")
    ap.add_argument("--weights", default=None, choices=["float32", "bfloat16", "float16"],
                    help="also write random weights in this dtype (transformers)")
    ap.add_argument("--smoke", action="store_true", help="write into a temporary directory")
    ns = ap.parse_args()
    if ns.out is None and not ns.smoke:
        ap.error("--out is required")
    out = write_model_dir(ns.model, ns.out or tempfile.mkdtemp(prefix="skyline-smoke-"))
    if ns.weights:
        write_random_weights(out, ns.weights)
    print(out)


def write_random_weights(path: str, dtype: str) -> None:
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.eval().save_pretrained(path, safe_serialization=True)


if __name__ == "__main__":
    main()
