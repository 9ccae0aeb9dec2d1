"""Benchmark workloads: each yields conversations (one or more turns) for the load generator.

Lengths are in tokens. Prompt text is built from a list of common English words (about one
token each); the load generator makes prompts token-exact when the server can tokenize.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

WORKLOADS = ("random", "shared-prefix", "multi-turn", "code-edit", "long-context", "mixed",
             "file")
MAX_LONG_CONTEXT = 200_000

_WORDS = (
    "the of and to in is was for that on as with by at from his her an it which be are were "
    "this had not but have or all their one has been they its new more who after first two "
    "also time other into most over only some these would can city year school may many world "
    "state about under when people during through while later river house water light north "
    "south early music team three great small long high day name part war made same game main "
    "book four found film line back city age form field power land order market history old "
    "large model system work place group point page story number family village station road"
).split()
_TOPICS = ("rivers", "bridges", "music", "trains", "gardens", "the moon", "bread", "chess",
           "volcanoes", "libraries", "bees", "glass", "maps", "clocks", "salt", "paper")


@dataclass
class Turn:
    prompt: str | list[int]  # text, or token ids (completions endpoint only)
    max_tokens: int
    input_len: int  # tokens this turn adds (estimated until tokenized)


@dataclass
class Conversation:
    turns: list[Turn]
    system: str | None = None
    messages: list[dict[str, Any]] | None = None  # a file entry given as chat messages


@dataclass
class WorkloadSpec:
    name: str = "random"
    input_len: str = "128"  # "N" or "LO:HI" (uniform)
    output_len: str = "64"
    system_prompt_len: int = 512  # shared-prefix
    num_turns: int = 3  # multi-turn
    path: str | None = None  # file: JSONL of {"prompt"} or {"messages"}, optional "max_tokens"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    num_prefixes: int = 1  # shared-prefix: distinct system prompts, each conversation one of them
    # mixed: this fraction of the requests are long prompts of `long_len` tokens ("N" or
    # "LO:HI"), the others short chats of `input_len`
    long_fraction: float = 0.1
    long_len: str = "4096"


def parse_len(spec: str | int, what: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256)."""
    lo, _, hi = str(spec).partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        a, b = 0, -1
    if a < 1 or b < a:
        raise ValueError(f"{what} takes N or LO:HI with 1 <= LO <= HI, got {spec!r}")
    return a, b


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _code(rng: random.Random, n_tokens: int) -> str:
    """Python-looking source of about n_tokens tokens (about 12 tokens a line)."""
    lines = []
    i = 0
    while len(lines) * 12 < n_tokens:
        fn = f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}_{i}"
        lines += [f"def {fn}(value, count):", f"    total = value * {rng.randint(2, 99)}",
                  "    for step in range(count):", f"        total += step - {rng.randint(1, 9)}",
                  "    return total", ""]
        i += 1
    return "\n".join(lines)


def make_conversations(spec: WorkloadSpec, num: int) -> list[Conversation]:
    """The first `num` conversations of the workload."""
    return list(itertools.islice(iter_conversations(spec), num))


def iter_conversations(spec: WorkloadSpec) -> Iterator[Conversation]:
    """The workload's conversations, endless and deterministic for a seed; arguments are
    checked before the first one is made."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec.name!r}; choose one of {', '.join(WORKLOADS)}")
    if spec.name == "file":
        return itertools.cycle(_from_file(spec))
    in_lo, in_hi = parse_len(spec.input_len, "--input-len")
    out_lo, out_hi = parse_len(spec.output_len, "--output-len")
    if spec.num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be at least 1, got {spec.num_prefixes}")
    if not 0 <= spec.long_fraction <= 1:
        raise ValueError(f"--long-fraction must be in [0, 1], got {spec.long_fraction}")
    parse_len(spec.long_len, "--long-len")
    if spec.name == "long-context" and in_hi > MAX_LONG_CONTEXT:
        raise ValueError(f"--input-len is at most {MAX_LONG_CONTEXT} for long-context")
    return _generate(spec, in_lo, in_hi, out_lo, out_hi)


def _generate(spec: WorkloadSpec, in_lo: int, in_hi: int, out_lo: int,
              out_hi: int) -> Iterator[Conversation]:
    rng = random.Random(spec.seed)
    systems = [words(random.Random(spec.seed + 1 + 1000 * g), spec.system_prompt_len)
               for g in range(spec.num_prefixes)]
    for i in itertools.count():
        n_in, n_out = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        if spec.name == "random":
            yield Conversation([Turn(words(rng, n_in), n_out, n_in)])
        elif spec.name == "shared-prefix":
            q = f"Question {i}: tell me about {rng.choice(_TOPICS)}. {words(rng, n_in)}"
            system = systems[rng.randrange(spec.num_prefixes)] if spec.num_prefixes > 1 \
                else systems[0]
            yield Conversation([Turn(q, n_out, n_in)], system=system)
        elif spec.name == "multi-turn":
            turns = []
            for t in range(spec.num_turns):
                q = f"Turn {t}: say more about {rng.choice(_TOPICS)}. {words(rng, n_in)}"
                turns.append(Turn(q, rng.randint(out_lo, out_hi), n_in))
            yield Conversation(turns)
        elif spec.name == "code-edit":
            old, new = rng.choice(_WORDS), f"renamed_{i}"
            q = (f"Rename every '{old}' to '{new}' in this file and output the whole file "
                 f"unchanged otherwise.\n\n{_code(rng, n_in)}")
            yield Conversation([Turn(q, n_out, n_in)])
        elif spec.name == "mixed":
            if rng.random() < spec.long_fraction:
                lo, hi = parse_len(spec.long_len, "--long-len")
                n_in = rng.randint(lo, hi)
            yield Conversation([Turn(words(rng, n_in), n_out, n_in)])
        else:  # long-context: a long document, then a short question about it
            q = f"{words(rng, n_in)}\n\nWhich {rng.choice(_TOPICS)} does the text mention?"
            yield Conversation([Turn(q, n_out, n_in)])


def _from_file(spec: WorkloadSpec) -> list[Conversation]:
    if not spec.path:
        raise ValueError("the file workload needs --dataset PATH (JSONL)")
    _, out_hi = parse_len(spec.output_len, "--output-len")
    entries = []
    try:
        with open(spec.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    entries.append((n, json.loads(line)))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {spec.path} ({e}); give a UTF-8 JSONL file") from None
    if not entries:
        raise ValueError(f"{spec.path} has no prompts")
    convs = []
    for n, e in entries:
        if not isinstance(e, dict) or not ("prompt" in e or "messages" in e):
            raise ValueError(f"{spec.path} line {n}: give an object with 'prompt' or 'messages'")
        max_tokens = int(e.get("max_tokens", e.get("output_len", out_hi)))
        if "messages" in e:
            text = " ".join(str(m.get("content", "")) for m in e["messages"])
            turn = Turn(text, max_tokens, len(text.split()))
            convs.append(Conversation([turn], messages=e["messages"]))
        else:
            p = e["prompt"]
            convs.append(Conversation([Turn(p, max_tokens, len(p) if isinstance(p, list)
                                            else len(str(p).split()))]))
    return convs
