"""The CLI's shared flag groups: engine, sampling, and workload/load (`skyline bench serve` and
`skyline frontier`), and their conversion to EngineArgs / SamplingParams / load specs."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from skyline.config import POLICIES, RouterConfig
from skyline.engine.args import EngineArgs
from skyline.types import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None,
                   help="HF model directory, .gguf file, or shipped config name (with "
                        "--load-format dummy); default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--load-format", default="auto",
                   choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default="2GiB", help="CPU KV cache size, e.g. 4GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-blocks", type=int, default=None, help="fixed KV block count")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype) | fp8 (e4m3 with per-layer scales: twice the "
                        "tokens of a bf16 cache)")
    g.add_argument("--kv-offload-ram", default="0", metavar="SIZE",
                   help="pinned host RAM for KV blocks evicted from the device, e.g. 64GiB: a "
                        "prefix found there is copied back instead of recomputed")
    g.add_argument("--kv-offload-disk", default=None, metavar="DIR",
                   help="a directory for KV blocks below RAM; it survives restarts and "
                        "replicas on one host may share it")
    g.add_argument("--kv-offload-disk-size", default=None, metavar="SIZE",
                   help="the most the disk tier holds (default: 90%% of the free space)")
    g.add_argument("--kv-offload-policy", default="eviction", choices=["eviction", "eager"],
                   help="eviction: blocks are written down as they leave a tier; eager: every "
                        "full block is written to every tier once computed")
    g.add_argument("--kv-offload-dtype", default="auto", choices=["auto", "fp8", "int8"],
                   help="blocks in RAM and on disk quantized per token and head (half the "
                        "bytes of a 16-bit cache; lossy); auto: as the device holds them")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None, help="CPU threads")
    g.add_argument("--quantization", default=None,
                   help="none | fp8 | int8 | int4 | mxfp4 | nvfp4 | gguf (default: the "
                        "checkpoint's own format; GGUF files dequantize at load)")
    g.add_argument("--quant-group-size", type=int, default=128,
                   help="int8/int4: input elements per scale")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="the LM head in fp8 (W8A8), with any --quantization: half its bytes "
                        "per decode step; an e4m3 copy beside the dense weight")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    g.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="schedule the next step while the device runs this one "
                        "(auto: on for CUDA)")
    g.add_argument("--speculative-method", default="none",
                   choices=["none", "ngram", "suffix", "eagle", "draft"],
                   help="speculative decoding: ngram (prompt lookup), suffix (the request "
                        "and recent traffic), eagle (a trained head, --speculative-model) or "
                        "draft (a smaller model with the same tokenizer, --speculative-model)")
    g.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="eagle: the head's directory, written by `skyline train-speculator` "
                        "(default for the embedded model: the head shipped for it); draft: the "
                        "draft model (HF directory, .gguf file or shipped config name)")
    g.add_argument("--speculative-draft-layers", type=int, default=0, metavar="N",
                   help="draft without --speculative-model: the target's own first N layers "
                        "(weights shared) draft for it")
    g.add_argument("--no-eagle-lookup", dest="eagle_lookup", action="store_false",
                   help="eagle: head drafts only, no prompt lookup for repeated spans")
    g.add_argument("--num-speculative-tokens", type=int, default=5,
                   help="most draft tokens verified per request and step")
    g.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram match proposed")
    g.add_argument("--ngram-max", type=int, default=5, help="longest n-gram match tried")
    g.add_argument("--speculative-max-batch-tokens", type=int, default=None,
                   help="no speculation in steps with more tokens than this (default: 16 on "
                        "CPU, 256 on GPU)")
    g.add_argument("--no-speculative-gate", dest="speculative_gate", action="store_false",
                   help="speculate in every step (within --speculative-max-batch-tokens), not "
                        "only in batch sizes where speculative steps were measured faster")


def engine_args(ns: argparse.Namespace, **extra: Any) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    kw.update(extra)
    return EngineArgs(**kw)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def sampling_params(ns: argparse.Namespace) -> SamplingParams:
    p = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                       top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                       seed=ns.sampling_seed)
    p.validate()
    return p


def add_load_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """Workload and load flags of `skyline bench serve` and `skyline frontier`."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="random",
                   choices=["random", "shared-prefix", "multi-turn", "code-edit",
                            "long-context", "mixed", "file"])
    g.add_argument("--input-len", default="128", help="prompt tokens: N or LO:HI")
    g.add_argument("--output-len", default="64", help="generated tokens: N or LO:HI")
    g.add_argument("--system-prompt-len", type=int, default=512, help="shared-prefix workload")
    g.add_argument("--num-prefixes", type=int, default=1,
                   help="shared-prefix workload: distinct system prompts")
    g.add_argument("--long-fraction", type=float, default=0.1,
                   help="mixed workload: the fraction of long prompts among short ones")
    g.add_argument("--long-len", default="4096", help="mixed workload: long prompts' tokens")
    g.add_argument("--num-turns", type=int, default=3, help="multi-turn workload")
    g.add_argument("--dataset", default=None, help="file workload: JSONL of {prompt|messages}")
    g = p.add_argument_group("load")
    g.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    if sweep:
        g.add_argument("--concurrency", default="1,4", help="load levels, e.g. 1,8,32")
    else:
        g.add_argument("--concurrency", type=int, default=None, help="requests in flight")
        g.add_argument("--request-rate", type=float, default=None,
                       help="Poisson arrivals per second (with --concurrency: a cap)")
    g.add_argument("--num-requests", type=int, default=None, help="default: 100 unless "
                   "--duration is given")
    g.add_argument("--duration", type=float, default=None, help="seconds")
    g.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="latency objectives, e.g. ttft:500 tpot:50")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths are then not exact)")
    g.add_argument("--bench-seed", type=int, default=0)


def load_specs(ns: argparse.Namespace) -> tuple[Any, Any, dict[str, float]]:
    from skyline.bench.metrics import parse_goodput
    from skyline.bench.serve import LoadSpec
    from skyline.bench.workloads import WorkloadSpec

    workload = WorkloadSpec(ns.workload, ns.input_len, ns.output_len, ns.system_prompt_len,
                            ns.num_turns, ns.dataset, ns.bench_seed,
                            num_prefixes=ns.num_prefixes, long_fraction=ns.long_fraction,
                            long_len=ns.long_len)
    num = ns.num_requests if ns.num_requests is not None or ns.duration else 100
    load = LoadSpec(endpoint=ns.endpoint, num_requests=num, duration=ns.duration,
                    ignore_eos=ns.ignore_eos, seed=ns.bench_seed)
    return load, workload, parse_goodput(ns.goodput)


def add_router_args(p: argparse.ArgumentParser | Any) -> None:
    """How `skyline router` (and `skyline serve --replicas N`) spreads requests."""
    p.add_argument("--policy", default="cache-aware", choices=list(POLICIES),
                   help="cache-aware: where the prompt's prefix is cached, unless that replica "
                        "is overloaded; round-robin; least-load: fewest requests open")
    p.add_argument("--balance-abs", type=int, default=4,
                   help="cache-aware: a replica with this many more open requests than the "
                        "least-loaded one ...")
    p.add_argument("--balance-rel", type=float, default=1.5,
                   help="... and more than this many times as many is overloaded")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health checks of each replica")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="replicas a request is tried on before it starts")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=256,
                   help="prefill/decode: prompts with fewer uncached tokens are prefilled on "
                        "the decode replica")


def router_config(ns: argparse.Namespace, replicas: list[str], api_key: str | None) -> RouterConfig:
    return RouterConfig(replicas=tuple(replicas), policy=ns.policy, balance_abs=ns.balance_abs,
                        balance_rel=ns.balance_rel, health_interval_s=ns.health_interval,
                        max_attempts=ns.max_attempts, api_key=api_key,
                        pd_min_prompt_tokens=ns.pd_min_prompt_tokens)


# `skyline serve` flags a replica of `--replicas N` does not inherit: the launcher sets them
# per replica, or they are the router's.
FLEET_ONLY_FLAGS = ("--replicas", "--ray", "--port", "--host", "--role", "--kv-events-port",
                    "--kv-transfer-port",
                    "--policy", "--balance-abs", "--balance-rel", "--health-interval",
                    "--max-attempts", "--pd-min-prompt-tokens", "--device", "--threads",
                    "--gpu-memory-utilization", "--ray-address", "--ray-num-gpus")
_SWITCHES = ("--ray",)


def strip_flags(argv: list[str], flags: tuple[str, ...] = FLEET_ONLY_FLAGS,
                switches: tuple[str, ...] = _SWITCHES) -> list[str]:
    """`argv` without `flags` (as `--flag value` or `--flag=value`; `switches` take none)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in flags:
            i += 1 if (name in switches or "=" in a) else 2
            continue
        out.append(a)
        i += 1
    return out
