"""The offline Python API: `LLM(model).generate(prompts, params)` and `LLM.chat(...)`."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from skyline.config import ModelConfig
from skyline.engine.args import EngineArgs
from skyline.engine.core import EngineCore, StepObserver, fewer_collections
from skyline.engine.create import create_engine_config
from skyline.engine.frontend.output import OutputProcessor, child_params
from skyline.engine.frontend.structured import check_structured, structured_outputs
from skyline.engine.frontend.tokenizer import Tokenizer
from skyline.types import Request, RequestOutput, SamplingParams
from skyline.types.startup import StartupPhases, expand, format_phases

log = logging.getLogger(__name__)

Prompt = str | list[int]


def load_tokenizer(cfg: ModelConfig) -> Tokenizer | None:
    """The model's tokenizer; None for a model directory without one (dummy weights from a
    bare config.json, test models): such an engine takes prompt token ids only."""
    if cfg.load_format != "gguf" and not os.path.exists(os.path.join(cfg.path, "tokenizer.json")):
        log.info("%s has no tokenizer.json: prompts must be token ids", cfg.path)
        return None
    return Tokenizer.load(cfg.path)


class LLM:
    """Runs many prompts with continuous batching on one engine, in this process."""

    def __init__(self, model: str | None = None, observers: Sequence[StepObserver] = (),
                 **kwargs: Any) -> None:
        """`kwargs` are EngineArgs; `observers` are told of every engine step
        (engine/core.py)."""
        self.args = EngineArgs(model=model, **kwargs)
        started = StartupPhases()
        with started.phase("config"):
            config, auto_len = create_engine_config(self.args)
        with started.phase("tokenizer"):
            self.tokenizer = load_tokenizer(config.model)
        structured = (structured_outputs(config.model, lambda: self.tokenizer)
                      if self.tokenizer is not None else None)
        with started.phase("engine"):
            self.engine = EngineCore(config, max_model_len_auto=auto_len, structured=structured,
                                     observers=observers)
        # Seconds of this start by phase, the runner's in place of the engine's (the phases
        # add up to the constructor's time; `query("describe")` has the runner's details).
        self.startup: dict[str, float] = expand(
            started.seconds, "engine", self.engine.executor.query("describe")["startup"])
        log.info("engine started in %.1f s: %s", sum(self.startup.values()),
                 format_phases(self.startup))
        self.config = self.engine.config
        self._ids = itertools.count()
        self.outputs = OutputProcessor(self.tokenizer)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return self.config.model.arch.eos_token_ids

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams,
                    request_id: str | None = None) -> str:
        params.validate(self.config.model.arch.vocab_size)
        check_structured(params)
        text, ids = self.encode(prompt)
        rid = request_id or str(next(self._ids))
        children = self.outputs.add_request(rid, text, ids, params)
        try:
            for i, cid in enumerate(children):
                self.engine.add_request(Request(cid, ids, child_params(params, i),
                                                eos_token_ids=self.eos_token_ids))
        except ValueError:
            self.abort(rid)
            raise
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort_requests(self.outputs.abort(request_id))

    def step(self, delta: bool = False, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; the requests it advanced (`final_only`: only those it finished)."""
        results, to_abort = self.outputs.process(self.engine.step(), delta=delta,
                                                 final_only=final_only)
        if to_abort:
            self.engine.abort_requests(to_abort)
        return results

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        order = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm)
        with fewer_collections():
            while self.engine.has_unfinished():
                for out in self.step(final_only=True):
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        bar.close()
        return [done[r] for r in order]

    def stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[RequestOutput]:
        """Yields deltas of one request as the engine produces them."""
        rid = self.add_request(prompt, params)
        try:
            while self.engine.has_unfinished():
                for out in self.step(delta=True):
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    def score(self, prompt: Prompt, window: int = 512) -> list[Any]:
        """Next-token log-probs at every position of the prompt (teacher forcing), scored in
        independent windows of `window` tokens: a list of [window_len, vocab] float32 tensors."""
        _, ids = self.encode(prompt)
        return [self.engine.executor.query("score", ids[s : s + window])
                for s in range(0, len(ids), window)]

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks of `config.cache.block_size` tokens."""
        return self.engine.executor.num_blocks

    def query(self, name: str, *args: Any) -> Any:
        """Ask the loaded model a question of worker/queries.py (hidden states, calibration,
        a quantized checkpoint, ...), wherever its workers run."""
        return self.engine.executor.query(name, *args)

    def shutdown(self) -> None:
        """Release the engine's workers (idempotent)."""
        self.engine.shutdown()

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm)
