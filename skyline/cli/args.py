"""The CLI's shared flag groups: engine, sampling, and workload/load (`skyline bench serve` and
`skyline frontier`), and their conversion to EngineArgs / SamplingParams / load specs."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from skyline.cli.values import (
    NON_NEGATIVE,
    POSITIVE,
    count_or_auto,
    float_in,
    int_in,
    size,
)
from skyline.config import POLICIES, RouterConfig
from skyline.engine.args import EngineArgs
from skyline.types import SamplingParams


def add_quiet(p: argparse.ArgumentParser) -> None:
    """`--quiet`, on every command (each of which calls this last)."""
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bars (they show only when stderr is a terminal)")
    p.set_defaults(leaf_parser=p)  # the command that reports an unknown flag


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None,
                   help="HF model directory, .gguf file, or shipped config name (with "
                        "--load-format dummy); default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--load-format", default="auto",
                   choices=["auto", "safetensors", "gguf", "dummy"],
                   help="auto: from the file (a shipped config name: dummy, random weights)")
    g.add_argument("--dtype", default="auto",
                   help="auto | float32 | bfloat16 | float16 (auto: float32 on a CPU, bfloat16 "
                        "for int4/int8/mxfp4 weights there; the checkpoint's 16-bit type on a "
                        "GPU)")
    g.add_argument("--device", default="auto",
                   help="auto | cpu | cuda | cuda:N (auto: a GPU if one is visible)")
    g.add_argument("--max-model-len", type=POSITIVE, default=None,
                   help="tokens of context per sequence, prompt and output (default: the "
                        "model's trained context)")
    g.add_argument("--block-size", type=POSITIVE, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=size, default="2GiB",
                   help="CPU KV cache size, e.g. 4GiB")
    g.add_argument("--gpu-memory-utilization", type=float_in(0, 1, lo_open=True), default=0.9,
                   help="the fraction of the GPU's memory for weights, activations and KV "
                        "cache")
    g.add_argument("--num-blocks", type=POSITIVE, default=None,
                   help="fixed KV block count (default: as many as the memory above holds)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt instead of reusing cached KV of its prefix")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype) | fp8 (e4m3 with per-layer scales: twice the "
                        "tokens of a bf16 cache)")
    g.add_argument("--kv-offload-ram", default="0", metavar="SIZE",
                   help="pinned host RAM for KV blocks evicted from the device, e.g. 64GiB: a "
                        "prefix found there is copied back instead of recomputed")
    g.add_argument("--kv-offload-disk", default=None, metavar="DIR",
                   help="a directory for KV blocks below RAM; it survives restarts and "
                        "replicas on one host may share it (default: no disk tier)")
    g.add_argument("--kv-offload-disk-size", default=None, metavar="SIZE",
                   help="the most the disk tier holds (default: 90%% of the free space)")
    g.add_argument("--kv-offload-policy", default="eviction", choices=["eviction", "eager"],
                   help="eviction: blocks are written down as they leave a tier; eager: every "
                        "full block is written to every tier once computed")
    g.add_argument("--kv-offload-dtype", default="auto", choices=["auto", "fp8", "int8"],
                   help="blocks in RAM and on disk quantized per token and head (half the "
                        "bytes of a 16-bit cache; lossy); auto: as the device holds them")
    g.add_argument("--max-num-seqs", type=count_or_auto, default="auto",
                   help="running requests at most: N, or auto (GPU: from the KV cache's "
                        "capacity and the CUDA-graph batch sizes; CPU: 64)")
    g.add_argument("--max-num-batched-tokens", type=POSITIVE, default=None,
                   help="tokens in one step (default: 1024 on a CPU, 8192 on a GPU)")
    g.add_argument("--schedule-conservativeness", type=float_in(0.0), default=1.0,
                   help="KV held back when admitting a request, for the output the running ones "
                        "are expected to add (learned share of their max_tokens, times this): "
                        "fewer preemptions by recompute; 0: admit on current need alone")
    g.add_argument("--seed", type=NON_NEGATIVE, default=0,
                   help="random seed (dummy weights, sampling without a per-request seed)")
    g.add_argument("--threads", type=POSITIVE, default=None,
                   help="CPU threads (default: torch's, one per core)")
    g.add_argument("--quantization", default=None,
                   help="none | fp8 | int8 | int4 | mxfp4 | nvfp4 | gguf (default: the "
                        "checkpoint's own format; GGUF files dequantize at load)")
    g.add_argument("--quant-group-size", type=POSITIVE, default=128,
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
    g.add_argument("--speculative-draft-layers", type=NON_NEGATIVE, default=0, metavar="N",
                   help="draft without --speculative-model: the target's own first N layers "
                        "(weights shared) draft for it")
    g.add_argument("--no-eagle-lookup", dest="eagle_lookup", action="store_false",
                   help="eagle: head drafts only, no prompt lookup for repeated spans")
    g.add_argument("--num-speculative-tokens", type=POSITIVE, default=5,
                   help="most draft tokens verified per request and step")
    g.add_argument("--ngram-min", type=POSITIVE, default=2, help="shortest n-gram match proposed")
    g.add_argument("--ngram-max", type=POSITIVE, default=5, help="longest n-gram match tried")
    g.add_argument("--speculative-max-batch-tokens", type=POSITIVE, default=None,
                   help="no speculation in steps with more tokens than this (default: 16 on "
                        "CPU, 256 on GPU)")
    g.add_argument("--no-speculative-gate", dest="speculative_gate", action="store_false",
                   help="speculate in every step (within --speculative-max-batch-tokens), not "
                        "only in batch sizes where speculative steps were measured faster")
    add_parallel_args(p)


def add_tune_args(p: argparse.ArgumentParser) -> None:
    """`skyline tune`: its loop and the workload it measures (a CPU's defaults are smaller)."""
    g = p.add_argument_group("tune")
    g.add_argument("--budget-s", type=float_in(0, lo_open=True), default=300.0,
                   help="seconds of tuning and re-measuring, after the first measurement")
    g.add_argument("--rounds", type=POSITIVE, default=3,
                   help="families tuned at most, the one losing the most time first")
    g.add_argument("--min-gain", type=float_in(0, 1), default=0.02,
                   help="a round's tables are kept if the phases its kernels run in get "
                        "faster by more than this fraction")
    g.add_argument("--batch", type=POSITIVE, default=None,
                   help="sequences decoding at once in the batched decode phase (default: 32 "
                        "on a GPU, 8 on a CPU)")
    g.add_argument("--context", type=POSITIVE, default=None,
                   help="their context (prompt tokens) as they decode (default: 1024 on a "
                        "GPU, 256 on a CPU)")
    g.add_argument("--prefill-len", type=POSITIVE, default=None,
                   help="tokens of the prompt whose prefill is measured (default: 2048 on a "
                        "GPU, 512 on a CPU)")
    g.add_argument("--decode-steps", type=POSITIVE, default=None,
                   help="decode steps timed in each decode phase (default: 32 on a GPU, 16 "
                        "on a CPU)")
    g.add_argument("--reps", type=POSITIVE, default=3,
                   help="each phase's time is the median of this many runs")
    g.add_argument("--out", default=None, help="JSON report (default: none)")
    g.add_argument("--smoke", action="store_true",
                   help="a tiny random model on the CPU, a few steps, a temporary cache: the "
                        "loop's code in seconds (CI)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel")
    g.add_argument("--tensor-parallel-size", "-tp", type=int_in(1), default=1,
                   help="ranks that split every layer (heads, MLP, vocabulary)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int_in(1), default=1,
                   help="pipeline stages, each a share of the layers")
    g.add_argument("--placement", default=None, metavar="auto|DEVICE=LAYERS,...",
                   help="one pipeline stage per device with its layer count, e.g. "
                        "cuda:0=28,cuda:1=20,cpu=8; auto: from each device's free memory and "
                        "measured speed, the CPU only for what the GPUs cannot hold (default: "
                        "none: the stages split the layers evenly)")
    g.add_argument("--expert-parallel", "-ep", action="store_true",
                   help="MoE: each stage's tensor-parallel ranks hold whole experts (1/N of "
                        "them each) and tokens travel to their experts' rank and back "
                        "(all-to-all); attention stays tensor-parallel (default: off: every "
                        "rank runs every token on its experts and the ranks sum)")
    g.add_argument("--n-cpu-moe", type=int_in(0), default=0, metavar="N",
                   help="MoE: keep the experts of the first N layers in host memory and run "
                        "them on the CPU, the rest of the model on the GPU (a model larger "
                        "than the GPU; CUDA graphs off); on a machine without a GPU there is "
                        "nothing to move (default: 0)")
    g.add_argument("--distributed-executor", default="auto", choices=["auto", "uni", "mp"],
                   help="mp: one process per rank (auto: beyond one rank); uni: in the "
                        "engine's process")
    g.add_argument("--distributed-init", default=None, metavar="tcp://HOST:PORT",
                   help="where ranks of several hosts meet (the engine's host and a free port; "
                        "default: none, one host)")
    g.add_argument("--nnodes", type=int_in(1), default=1, help="hosts sharing the ranks")
    g.add_argument("--node-rank", type=int_in(0), default=0,
                   help="this host's index (engine: 0)")
    g.add_argument("--distributed-timeout", type=float_in(0, lo_open=True), default=600.0,
                   metavar="SECONDS",
                   help="a rank unheard from this long stops the engine")


def engine_args(ns: argparse.Namespace, **extra: Any) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    kw.update(extra)
    return EngineArgs(**kw)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=POSITIVE, default=max_tokens,
                   help="tokens to generate at most")
    g.add_argument("--temperature", type=float_in(0), default=0.7, help="0: greedy")
    g.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this probability")
    g.add_argument("--top-k", type=int_in(-1), default=0,
                   help="sample among the k most likely tokens (0 or -1: all)")
    g.add_argument("--min-p", type=float_in(0, 1), default=0.0,
                   help="drop tokens less likely than this times the most likely one")
    g.add_argument("--repetition-penalty", type=float_in(0, lo_open=True), default=1.0,
                   help="divide the logits of tokens already seen by this (1: off)")
    g.add_argument("--sampling-seed", type=NON_NEGATIVE, default=None,
                   help="per-request seed (default: none, a fresh draw each run)")


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
                            "long-context", "mixed", "file"],
                   help="the prompts sent (file: --dataset)")
    g.add_argument("--input-len", default="128", help="prompt tokens: N or LO:HI")
    g.add_argument("--output-len", default="64", help="generated tokens: N or LO:HI")
    g.add_argument("--system-prompt-len", type=NON_NEGATIVE, default=512,
                   help="shared-prefix workload")
    g.add_argument("--num-prefixes", type=POSITIVE, default=1,
                   help="shared-prefix workload: distinct system prompts")
    g.add_argument("--long-fraction", type=float_in(0, 1), default=0.1,
                   help="mixed workload: the fraction of long prompts among short ones")
    g.add_argument("--long-len", default="4096", help="mixed workload: long prompts' tokens")
    g.add_argument("--num-turns", type=POSITIVE, default=3, help="multi-turn workload")
    g.add_argument("--dataset", default=None,
                   help="file workload: JSONL of {prompt|messages} (default: none)")
    g = p.add_argument_group("load")
    g.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="the OpenAI route requests go to")
    if sweep:
        g.add_argument("--concurrency", default="1,4", help="load levels, e.g. 1,8,32")
    else:
        g.add_argument("--concurrency", type=POSITIVE, default=None,
                       help="requests in flight (default: all at once, or by --request-rate)")
        g.add_argument("--request-rate", type=float_in(0, lo_open=True), default=None,
                       help="Poisson arrivals per second (with --concurrency: a cap; default: "
                            "none)")
    g.add_argument("--num-requests", type=POSITIVE, default=None, help="default: 100 unless "
                   "--duration is given")
    g.add_argument("--duration", type=float_in(0, lo_open=True), default=None,
                   help="seconds to send requests for (default: until --num-requests)")
    g.add_argument("--goodput", nargs="*", default=None, metavar="NAME:MS",
                   help="latency objectives, e.g. ttft:500 tpot:50 (default: none)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths are then not exact)")
    g.add_argument("--bench-seed", type=NON_NEGATIVE, default=0,
                   help="seed of the workload's prompts and arrivals")


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
    p.add_argument("--balance-abs", type=NON_NEGATIVE, default=4,
                   help="cache-aware: a replica with this many more open requests than the "
                        "least-loaded one ...")
    p.add_argument("--balance-rel", type=float_in(1), default=1.5,
                   help="... and more than this many times as many is overloaded")
    p.add_argument("--health-interval", type=float_in(0, lo_open=True), default=1.0,
                   help="seconds between health checks of each replica")
    p.add_argument("--max-attempts", type=POSITIVE, default=3,
                   help="replicas a request is tried on before it starts")
    p.add_argument("--pd-min-prompt-tokens", type=NON_NEGATIVE, default=256,
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
