"""Quality of a variant's next-token distributions against a reference's, on the same token
ids scored in the same windows (bench/quant_quality.py, bench/kv_cache_quality.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from skyline.engine.frontend.llm import LLM


def window_logprobs(llm: LLM, ids: list[int], window: int, *args: Any) -> list[torch.Tensor]:
    """float32 log-probs [len(w), vocab] of each independent window w of `window` tokens that
    has at least two (the `score` query, with its further `args`)."""
    return [llm.query("score", ids[s : s + window], *args)
            for s in range(0, len(ids) - 1, window) if len(ids[s : s + window]) >= 2]


def quality(logp: list[torch.Tensor], ref: list[torch.Tensor], ids: list[int], window: int
            ) -> dict[str, float]:
    """Perplexity of `ids` under `logp`, KL(reference || variant) per token and top-1
    agreement, over windows as window_logprobs made them."""
    nll, kl, agree, n = 0.0, 0.0, 0, 0
    for lp, rp, s in zip(logp, ref, range(0, len(ids), window), strict=False):
        targets = torch.tensor(ids[s + 1 : s + len(lp)])
        nll += -lp[:-1].gather(-1, targets[:, None]).sum().item()
        kl += F.kl_div(lp, rp, log_target=True, reduction="sum").item()
        agree += (lp.argmax(-1) == rp.argmax(-1)).sum().item()
        n += len(lp)
    return {"perplexity": float(torch.tensor(nll / (n - len(logp))).exp()), "kl": kl / n,
            "top1_agreement": agree / n}
