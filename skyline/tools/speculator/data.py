"""Training data for the EAGLE head (`skyline train-speculator`): prompts, the target's own
continuations, and the target's hidden states on them.

Sources, one example a line:
- `.txt`: an instruction per line, sent as a user message through the chat template;
- `.jsonl`: a string (as in .txt); {"prompt": ...} (an instruction; the target answers it);
  {"prompt": ..., "completion": ...} (recorded traffic, used as is: raw prompt text, no chat
  template); {"messages": [...]} (a chat; a last assistant message is its completion, else
  the target answers). Prompts and completions may also be lists of token ids; an object may
give its continuation's length ("max_tokens").
Without a file, the built-in instruction set `prompts.jsonl` is used (chat questions, writing
and code-editing tasks; it shares no prompt with the chat benchmark of bench/spec_decode.py).

More prompts than any file holds: `synthesize` has the target write user messages itself
(Magpie, Xu et al. 2024): given its chat template up to where a user message begins, an
instruction-tuned model samples a plausible request, as varied as the conversations it was
tuned on. No dataset is needed, and the requests are in the target's own distribution.

The features are the target's hidden states at every position of each finished sequence,
from a causal forward pass over it (the `hidden_states` query), once the engine has written
the continuations.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skyline import progress
from skyline.config import ConfigError
from skyline.tools import BUILTIN_PROMPTS
from skyline.types import SamplingParams

if TYPE_CHECKING:
    import torch

    from skyline.engine.frontend.llm import LLM

# Sequences per `hidden_states` query: few enough that one answer stays small.
FEATURE_BATCH = 16


@dataclass
class Example:
    prompt: list[int]
    completion: list[int] | None = None  # None: the target writes one
    max_tokens: int | None = None  # the continuation's length (None: record's default)


@dataclass
class Sample:
    """One training sequence: tokens, how many are prompt, and the target's features of
    positions 0..len(feats)-1 (the last token, never fed to the target, has none)."""

    token_ids: list[int]
    num_prompt: int
    feats: torch.Tensor  # [m, hidden], m <= len(token_ids)


def _ids(llm: LLM, value: Any, where: str, special: bool) -> list[int]:
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return list(value)
    if isinstance(value, str):
        if llm.tokenizer is None:
            raise ConfigError(f"{where}: this model has no tokenizer; give token ids instead "
                              "of text")
        return llm.tokenizer.encode(value, add_special_tokens=special)
    raise ConfigError(f"{where}: expected text or a list of token ids, got {type(value).__name__}")


def _chat(llm: LLM, messages: list[dict[str, Any]], where: str) -> list[int]:
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        raise ConfigError(f"{where}: this model has no chat template; give "
                          '{"prompt": ..., "completion": ...} examples instead')
    return llm.render_chat(messages)


def _example(llm: LLM, item: Any, where: str) -> Example:
    ex = _parse(llm, item, where)
    if isinstance(item, dict) and item.get("max_tokens") is not None:
        if not isinstance(item["max_tokens"], int) or item["max_tokens"] < 1:
            raise ConfigError(f"{where}: max_tokens must be a positive integer")
        ex.max_tokens = item["max_tokens"]
    return ex


def _parse(llm: LLM, item: Any, where: str) -> Example:
    if isinstance(item, str):
        return Example(_chat(llm, [{"role": "user", "content": item}], where))
    if isinstance(item, dict) and "messages" in item:
        msgs = item["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of messages")
        if msgs[-1].get("role") == "assistant" and len(msgs) > 1:
            completion = _ids(llm, msgs[-1].get("content", ""), where, special=False)
            return Example(_chat(llm, msgs[:-1], where), completion)
        return Example(_chat(llm, msgs, where))
    if isinstance(item, dict) and "prompt" in item:
        prompt = item["prompt"]
        if "completion" in item:
            return Example(_ids(llm, prompt, where, special=True),
                           _ids(llm, item["completion"], where, special=False))
        if isinstance(prompt, str):
            return Example(_chat(llm, [{"role": "user", "content": prompt}], where))
        return Example(_ids(llm, prompt, where, special=True))
    raise ConfigError(f"{where}: expected a string, {{\"prompt\": ...}} (with an optional "
                      "\"completion\") or {\"messages\": [...]}")


def read_examples(llm: LLM, path: str | None = None) -> list[Example]:
    """The examples of a .txt or .jsonl file (None: the built-in prompts)."""
    path = path or BUILTIN_PROMPTS
    if not os.path.isfile(path):
        raise ConfigError(f"prompt file {path!r} not found; give a .txt or .jsonl file")
    if not path.endswith((".txt", ".jsonl")):
        raise ConfigError(f"prompt file {path!r} must be .txt (one instruction a line) or "
                          ".jsonl (prompts, completions or chats)")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{lineno}"
            if path.endswith(".txt"):
                out.append(_example(llm, line, where))
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{where}: not valid JSON") from None
            out.append(_example(llm, item, where))
    if not out:
        raise ConfigError(f"prompt file {path!r} holds no examples")
    return out


def record(llm: LLM, examples: list[Example], max_tokens: int, temperature: float = 0.0,
           seed: int = 0) -> list[Sample]:
    """Run the target over the examples (writing the missing completions, up to `max_tokens`
    tokens, greedy or sampled at `temperature`) and return them with the target's features
    (of every token it would compute: all but a written continuation's last)."""
    max_len = llm.config.scheduler.max_model_len
    examples = [ex for ex in examples if 2 <= len(ex.prompt) < max_len - 1]
    for ex in examples:
        if ex.completion is not None:
            ex.completion = ex.completion[: max_len - 1 - len(ex.prompt)]
    todo = [i for i, ex in enumerate(examples) if ex.completion is None]
    params = [SamplingParams(temperature=temperature, max_tokens=examples[i].max_tokens
                             or max_tokens, seed=seed + i) for i in todo]
    outs = llm.generate([examples[i].prompt for i in todo], params,
                        use_tqdm=bool(todo) and progress.enabled())
    written = {i: list(out.outputs[0].token_ids) for i, out in zip(todo, outs, strict=True)}
    seqs = []  # (tokens, how many of them have a feature, prompt length)
    for i, ex in enumerate(examples):
        if ex.completion is None:
            tokens = ex.prompt + written[i]
            seqs.append((tokens, len(tokens) - 1, len(ex.prompt)))  # the last was never fed
        else:
            tokens = ex.prompt + ex.completion
            seqs.append((tokens, len(tokens), len(ex.prompt)))
    samples = []
    for s in range(0, len(seqs), FEATURE_BATCH):
        batch = seqs[s : s + FEATURE_BATCH]
        feats = llm.query("hidden_states", [tokens[:n] for tokens, n, _ in batch])
        samples += [Sample(tokens, num_prompt, f) for (tokens, _, num_prompt), f
                    in zip(batch, feats, strict=True) if f.shape[0] >= 2]
    return samples


# Synthesized user messages: sampled freely, kept if they ended by themselves and are at
# least this many tokens long (shorter ones are mostly greetings), each text once.
SYNTH_TEMPERATURE = 1.0
SYNTH_TOP_P = 0.95
SYNTH_MIN_TOKENS = 4
_SENTINEL = "\x00user message\x00"


def user_prefix(llm: LLM) -> list[int]:
    """The chat template's tokens up to where a user message's text begins (a system prompt
    the template adds by itself included)."""
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        raise ConfigError("--synthesize needs a model with a chat template (the target writes "
                          "user messages after its template's user header); give --prompts "
                          "instead")
    text = tok.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                   add_generation_prompt=True)
    if not isinstance(text, str) or text.count(_SENTINEL) != 1:
        raise ConfigError("--synthesize: this model's chat template does not place a user "
                          "message verbatim; give --prompts instead")
    return tok.encode(text[: text.index(_SENTINEL)], add_special_tokens=False)


def synthesize(llm: LLM, num: int, max_tokens: int = 128, seed: int = 0) -> list[Example]:
    """Up to `num` chat examples whose user message the target wrote (see the module
    docstring): sampled after `user_prefix`, kept if they ended with an end-of-turn token
    within `max_tokens` and are new and long enough, then rendered as user messages."""
    prefix = user_prefix(llm)
    params = [SamplingParams(temperature=SYNTH_TEMPERATURE, top_p=SYNTH_TOP_P,
                             max_tokens=max_tokens, seed=seed + i) for i in range(num)]
    outs = llm.generate([prefix] * num, params, use_tqdm=progress.enabled())
    seen: set[str] = set()
    examples = []
    for out in outs:
        c = out.outputs[0]
        text = c.text.strip()
        if c.finish_reason != "stop" or len(c.token_ids) < SYNTH_MIN_TOKENS or text in seen:
            continue
        seen.add(text)
        examples.append(Example(llm.render_chat([{"role": "user", "content": text}])))
    return examples


def sample_examples(examples: list[Example], num: int | None, seed: int) -> list[Example]:
    """`num` examples drawn without replacement (all of them if num is None or larger)."""
    if num is None or num >= len(examples):
        return examples
    return random.Random(seed).sample(examples, num)
