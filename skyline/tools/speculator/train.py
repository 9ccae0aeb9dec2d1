"""`skyline train-speculator`: load the target, have it write its continuations of the
prompts (data.py), and train an EAGLE head on its features where the model lives (the
`train_eagle_head` query: worker/spec/train.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Any

from skyline.config import TrainArgs
from skyline.engine.args import EngineArgs
from skyline.engine.frontend.llm import LLM
from skyline.tools.speculator import data

log = logging.getLogger(__name__)


def train_speculator(engine_args: EngineArgs, prompts: str | None, out_dir: str,
                     args: TrainArgs, num_prompts: int | None = None, max_tokens: int = 128,
                     temperature: float = 0.0, synthesize: int = 0,
                     command: str = "") -> dict[str, Any]:
    """The whole of `skyline train-speculator`: load the target (EngineArgs), write and record
    its continuations of the prompts (and of `synthesize` user messages it writes itself),
    train a head and save it to `out_dir`."""
    t0 = time.perf_counter()
    llm = LLM(**asdict(replace(engine_args, speculative_method="none",
                               enable_prefix_caching=False)))
    try:
        examples = data.sample_examples(data.read_examples(llm, prompts), num_prompts,
                                        args.seed)
        synthesized = []
        if synthesize:
            synthesized = data.synthesize(llm, synthesize, seed=args.seed)
            log.info("synthesized %d user messages (%d sampled) in %.0f s", len(synthesized),
                     synthesize, time.perf_counter() - t0)
        examples += synthesized
        samples = data.record(llm, examples, max_tokens, temperature, args.seed)
        record_s = time.perf_counter() - t0
        log.info("recorded %d sequences, %d positions in %.0f s", len(samples),
                 sum(s.feats.shape[0] for s in samples), record_s)
        about = {"command": command, "target": llm.config.model.name,
                 "prompts": prompts or "built-in", "num_examples": len(examples),
                 "num_synthesized": len(synthesized), "max_tokens": max_tokens,
                 "temperature": temperature, "record_seconds": round(record_s, 1)}
        return llm.query("train_eagle_head", [(s.token_ids, s.num_prompt, s.feats)
                                              for s in samples],
                         args, llm.eos_token_ids, out_dir, about)
    finally:
        llm.shutdown()
