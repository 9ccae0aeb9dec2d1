"""Calibration text the model writes itself: its answers, sampled as when serving
(temperature 0.7, top-p 0.9, fixed seeds), to the built-in instruction prompts of
skyline/tools/prompts.jsonl (chat questions, writing and code-editing tasks).

For a user without text of their own this is the text that matters: the quantized model will
be judged on what it writes. A famous public-domain text (calibration.txt) is partly
memorised by small models, and a few memorised passages dominate its KL: on the default model
the joint search that loses to the best uniform format at 4.5 bits on that text wins on this
one (BENCHMARKS.md, "Mixed precision chosen by end-to-end KL").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from skyline.tools import BUILTIN_PROMPTS
from skyline.types import SamplingParams

if TYPE_CHECKING:
    from skyline.engine.frontend.llm import LLM


def self_text(llm: LLM, num_tokens: int, max_tokens: int = 256, batch: int = 16) -> str:
    """The model's answers to the built-in prompts (prompt i sampled with seed i) until they
    hold `num_tokens` tokens, as plain text, answers separated by blank lines."""
    max_tokens = max(1, min(max_tokens, num_tokens))
    batch = max(1, min(batch, -(-num_tokens // max_tokens)))  # no more answers than needed
    with open(BUILTIN_PROMPTS, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    parts: list[str] = []
    total, i = 0, 0
    while total < num_tokens and i < len(prompts):
        chunk = prompts[i : i + batch]
        params = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens, seed=i + j)
                  for j in range(len(chunk))]
        outs = llm.chat([[{"role": "user", "content": p}] for p in chunk], params)
        for o in outs:
            parts.append(o.outputs[0].text.strip())
            total += len(o.outputs[0].token_ids)
        i += len(chunk)
    return "\n\n".join(parts)
