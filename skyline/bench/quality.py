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
    agreement, over windows as window_logprobs made them. (The worker's copy of this measure,
    quant/report.py, scores the format search; this package may not import it.)"""
    starts = range(0, len(ids), window)
    targets = torch.tensor([t for lp, s in zip(logp, starts, strict=False)
                            for t in ids[s + 1 : s + len(lp)]])
    predicted = torch.cat([lp[:-1] for lp in logp])  # positions that have a next token
    lp, rp = torch.cat(logp), torch.cat(ref)
    nll = -predicted.gather(-1, targets[:, None]).sum().item()
    return {"perplexity": float(torch.tensor(nll / len(targets)).exp()),
            "kl": F.kl_div(lp, rp, log_target=True, reduction="sum").item() / len(lp),
            "top1_agreement": (lp.argmax(-1) == rp.argmax(-1)).sum().item() / len(lp)}
