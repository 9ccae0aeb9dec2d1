"""The one argparse: `skyline serve | generate | chat | bench | frontier | tune | quantize ...`.
The commands live in commands.py and serve.py, their flags in args.py."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from skyline import envs, progress
from skyline.cli.args import (
    add_engine_args,
    add_load_args,
    add_quiet,
    add_router_args,
    add_sampling_args,
    add_tune_args,
    engine_args,
)
from skyline.cli.commands import (
    cmd_bench_offline,
    cmd_bench_serve,
    cmd_chat,
    cmd_frontier,
    cmd_generate,
    cmd_quantize,
    cmd_train_speculator,
    cmd_tune,
)
from skyline.cli.serve import cmd_router, cmd_serve, cmd_worker, serve_api_key
from skyline.cli.values import (
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    Parser,
    float_in,
    host,
    int_in,
    port_range,
)
from skyline.config import ConfigError
from skyline.server.tool_parsers import PARSERS

# Each API process holds a tokenizer and an event loop and one engine core feeds them all: past
# a few the core is the limit (BENCHMARKS.md), and 10000 would fork-bomb the machine
MAX_API_SERVERS = 64

__all__ = ["build_parser", "engine_args", "main", "serve_api_key"]


_UVICORN_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="skyline", description="LLM inference engine")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], type=str.upper,
                        help="how much the engine logs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    p.add_argument("prompt", help="the prompt (a user message, unless --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    add_engine_args(p)
    add_sampling_args(p)
    add_quiet(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("--system", default=None, help="system prompt (default: none)")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    add_quiet(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    p.add_argument("--host", type=host, default="127.0.0.1",
                   help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="the port to listen on (0: any free one, printed at start)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(visible in ps: prefer --api-key-file or $SKYLINE_API_KEY; default: "
                        "$SKYLINE_API_KEY, else no key)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from FILE (default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients ask for (default: the model's file or directory "
                        "name)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template to use instead of the model's (requests cannot "
                        "bring their own; default: the model's)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *PARSERS],
                   help="the format the model writes tool calls in (auto: the chat template's, "
                        "where it is unambiguous; ChatML templates: hermes)")
    p.add_argument("--max-waiting", type=int_in(-1), default=-1,
                   help="waiting requests beyond which new ones get 429 (-1: 4 x "
                        "--max-num-seqs; 0: no limit)")
    g = p.add_argument_group("request limits (a request over one gets a 400)")
    g.add_argument("--max-request-bytes", type=POSITIVE, default=16 << 20,
                   help="larger request bodies get 413")
    g.add_argument("--max-prompt-chars", type=NON_NEGATIVE, default=0,
                   help="characters in a prompt or a conversation (0: 32 per token of context, "
                        "at least 1Mi)")
    g.add_argument("--max-n", type=POSITIVE, default=128,
                   help="choices per request (n, times the prompts of a batched completion)")
    g.add_argument("--max-stop", type=NON_NEGATIVE, default=32,
                   help="stop strings, and stop token ids, per request")
    g.add_argument("--max-stop-chars", type=POSITIVE, default=1000,
                   help="characters per stop string")
    g.add_argument("--max-logprobs", type=NON_NEGATIVE, default=20,
                   help="top logprobs per token")
    g.add_argument("--max-tools", type=NON_NEGATIVE, default=128,
                   help="tools per request, and calls in one past assistant message")
    g.add_argument("--max-schema-bytes", type=POSITIVE, default=64 << 10,
                   help="a response_format JSON schema, a structured-output constraint, or one "
                        "tool, as JSON")
    g.add_argument("--max-logit-bias", type=NON_NEGATIVE, default=300,
                   help="tokens one logit_bias may name")
    g.add_argument("--prepare-timeout", type=float_in(0, lo_open=True), default=10.0,
                   help="seconds to parse a request, render its chat template and tokenize it")
    g.add_argument("--body-timeout", type=float_in(0, lo_open=True), default=30.0,
                   help="seconds for a request body to arrive (then 408)")
    p.add_argument("--api-server-count", type=int_in(1, MAX_API_SERVERS), default=1,
                   help="API processes (HTTP, tokenization, detokenization) in front of the one "
                        "engine core, all on --port: more when one cannot keep up with the "
                        "engine's streams (hundreds of users on a GPU); at most "
                        f"{MAX_API_SERVERS}")
    p.add_argument("--parse-workers", type=NON_NEGATIVE, default=2,
                   help="processes that parse large request bodies off the event loop")
    p.add_argument("--shutdown-timeout", type=float_in(0), default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    p.add_argument("--max-engine-restarts", type=NON_NEGATIVE, default=5,
                   help="restarts of a failed engine core allowed within ten minutes (with "
                        "backoff); one more failure stops the server, exit code 1 (0: none)")
    p.add_argument("--uvicorn-log-level", default="info", choices=_UVICORN_LEVELS,
                   help="how much the HTTP server logs")
    p.add_argument("--role", default="both",
                   help="both | prefill | decode: the work a router sends this replica (with "
                        "--replicas: one role for all, or one per replica, comma-separated)")
    p.add_argument("--kv-events-port", type=int_in(0, 65534), default=None,
                   help="publish KV events for a router on this port (ZMQ PUB; snapshots on "
                        "the next port); 0: any free pair (default: none published)")
    p.add_argument("--kv-transfer-port", type=PORT, default=None,
                   help="--role prefill: the port decode replicas pull KV from (default: any "
                        "free one, given in GET /fleet)")
    add_engine_args(p)
    g = p.add_argument_group("fleet (several engines behind a router on --port)")
    g.add_argument("--replicas", type=POSITIVE, default=1,
                   help="engines to start on this host (devices split among them; on the CPU "
                        "the cores)")
    g.add_argument("--ray", action="store_true",
                   help="run the replicas and the router as Ray Serve deployments")
    g.add_argument("--ray-address", default=None,
                   help="--ray: the cluster to join (default: start a local one)")
    g.add_argument("--ray-num-gpus", type=float_in(0), default=None,
                   help="--ray: GPUs per replica (default: 1 on CUDA, 0 on the CPU)")
    add_router_args(g)
    add_quiet(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="run this host's ranks of an engine started on another "
                                      "host with --nnodes")
    p.add_argument("--distributed-init", required=True, metavar="tcp://HOST:PORT",
                   help="the engine's --distributed-init")
    p.add_argument("--node-rank", type=int_in(1), required=True,
                   help="this host's index, from 1")
    p.add_argument("--nnodes", type=int_in(2), default=None,
                   help="checked against the engine's (default: none, not checked)")
    add_quiet(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("router", help="one OpenAI-compatible endpoint over several replicas")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat per replica)")
    p.add_argument("--host", type=host, default="127.0.0.1",
                   help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=PORT, default=8000, help="the port to listen on")
    p.add_argument("--model", "-m", default=None,
                   help="the replicas' model (its tokenizer and chat template hash prompts "
                        "for cache-aware routing); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' of clients and send it to the "
                        "replicas (default: $SKYLINE_API_KEY)")
    p.add_argument("--uvicorn-log-level", default="info", choices=_UVICORN_LEVELS,
                   help="how much the HTTP server logs")
    add_router_args(p)
    add_quiet(p)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("offline", help="offline throughput on random prompts")
    b.add_argument("--num-prompts", type=POSITIVE, default=64, help="prompts, all at once")
    b.add_argument("--input-len", type=POSITIVE, default=128, help="tokens per prompt")
    b.add_argument("--output-len", type=POSITIVE, default=128, help="tokens per output")
    b.add_argument("--output", default=None, help="JSON file for the results (default: none)")
    b.add_argument("--floor", action="store_true",
                   help="measure the device's matmul peak and copy bandwidth first and report "
                        "the run against the floor they set")
    b.add_argument("--temperature", type=float_in(0), default=0.0, help="0: greedy")
    b.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0,
                   help="nucleus of each draw (1: the whole vocabulary)")
    add_engine_args(b)
    add_quiet(b)
    b.set_defaults(func=cmd_bench_offline)
    b = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)")
    b.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's API")
    b.add_argument("--model", default=None, help="model name (default: the server's first)")
    b.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    b.add_argument("--temperature", type=float_in(0), default=0.0, help="0: greedy")
    b.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0,
                   help="nucleus of each draw (1: the whole vocabulary)")
    b.add_argument("--output", default=None, help="JSON file for the results (default: none)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_load_args(b)
    add_quiet(b)
    b.set_defaults(func=cmd_bench_serve)

    p = sub.add_parser("tune", help="tune kernels for this device: profile a workload, tune "
                                    "the family that loses the most time, keep what wins")
    add_tune_args(p)
    add_engine_args(p)
    add_quiet(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("frontier", help="sweep engine settings x load levels; Pareto report")
    p.add_argument("--grid", action="append", metavar="FLAG=V1,V2",
                   help="a serve flag and its values, e.g. max_num_seqs=8,32 (repeatable; "
                        "true/false for switches; default: the base flags alone)")
    p.add_argument("--base-flags", default="", help="serve flags every setting shares")
    p.add_argument("--output-dir", default="bench/tmp/frontier",
                   help="where the JSON, plots and HTML report go")
    p.add_argument("--dry-run", action="store_true", help="list the points and a time estimate")
    p.add_argument("--no-quality", dest="quality", action="store_false",
                   help="skip KL / top-1 agreement against the reference")
    p.add_argument("--reference-flags", default="--quantization none",
                   help="flags (over --base-flags) of the quality reference")
    p.add_argument("--calib-tokens", type=POSITIVE, default=512,
                   help="tokens of calibration text")
    p.add_argument("--num-gpus", type=POSITIVE, default=1, help="devices a setting uses")
    p.add_argument("--percentile", default="median", choices=["median", "p90", "p99"],
                   help="latency percentile of the per-user axes")
    p.add_argument("--startup-timeout", type=float_in(0, lo_open=True), default=600.0,
                   help="seconds a setting's server may take to start")
    p.add_argument("--port", type=port_range, default=None, metavar="PORT|LO-HI",
                   help="the port of each setting's server (one runs at a time): this one, or "
                        "the first free one in LO-HI (default: any free port)")
    add_load_args(p, sweep=True)
    add_quiet(p)
    p.set_defaults(func=cmd_frontier)

    p = sub.add_parser("quantize", help="write a quantized safetensors checkpoint")
    p.add_argument("model_path", metavar="MODEL", help="HF model directory or .gguf file")
    p.add_argument("--format", default=None, choices=["fp8", "int8", "int4", "mxfp4", "nvfp4"],
                   help="one format for every Linear (no default: give it, or --search)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--group-size", type=POSITIVE, default=128, help="int8/int4 group size")
    p.add_argument("--calib-file", default=None,
                   help="calibration text file (default: a built-in public-domain text)")
    p.add_argument("--calib-self", action="store_true",
                   help="calibrate on the model's own answers to built-in prompts (sampled "
                        "first; the text it will write when serving)")
    p.add_argument("--calib-tokens", type=POSITIVE, default=None,
                   help="calibration tokens (default 4096; with --search 1024, and the "
                        "following --eval-tokens are held out for the report)")
    p.add_argument("--search", action="store_true",
                   help="choose a format per Linear for --budget by the end-to-end KL")
    p.add_argument("--budget", default=None,
                   help="--search: bits per weight (e.g. 4.5), bytes of the Linear layers "
                        "(e.g. 60MiB), or a format (e.g. int4-g32: its uniform size); no "
                        "default")
    p.add_argument("--formats", default=None,
                   help="--search: candidate formats, comma-separated; int4/int8 take -gN for "
                        "a group size (default: mxfp4,nvfp4,int4,int4-g64,int4-g32,fp8,int8)")
    p.add_argument("--eval-tokens", type=POSITIVE, default=1024,
                   help="--search: held-out tokens the report is measured on")
    p.add_argument("--search-tokens", type=POSITIVE, default=512,
                   help="--search: calibration tokens each assignment is scored on")
    p.add_argument("--max-evals", type=POSITIVE, default=64,
                   help="--search: joint evaluations of the local search")
    add_quiet(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("train-speculator",
                       help="train an EAGLE-style speculative head by self-distillation")
    add_engine_args(p)
    t = p.add_argument_group("training")
    t.add_argument("--prompts", default=None, metavar="FILE",
                   help=".txt (an instruction a line) or .jsonl (prompts, {prompt, completion} "
                        "traffic or chat messages); default: the built-in instruction set")
    t.add_argument("--out", required=True, metavar="DIR", help="where to write the head")
    t.add_argument("--num-prompts", type=POSITIVE, default=None,
                   help="sample this many prompts (default: all)")
    t.add_argument("--synthesize", type=NON_NEGATIVE, default=0, metavar="N",
                   help="also train on N user messages the target writes itself after its "
                        "chat template's user header (Magpie); kept if they end by themselves")
    t.add_argument("--max-tokens", type=POSITIVE, default=128,
                   help="tokens of each continuation the target writes")
    t.add_argument("--temperature", type=float_in(0), default=0.0,
                   help="continuations: 0 greedy, else sampled")
    t.add_argument("--epochs", type=POSITIVE, default=4, help="passes over the data")
    t.add_argument("--steps", type=POSITIVE, default=None,
                   help="stop after this many steps (default: when the epochs end)")
    t.add_argument("--lr", type=float_in(0, lo_open=True), default=2e-3, help="learning rate")
    t.add_argument("--batch-tokens", type=POSITIVE, default=2048, help="positions per step")
    t.add_argument("--unroll", type=POSITIVE, default=3,
                   help="draft steps simulated in training (training-time test)")
    t.add_argument("--draft-vocab", type=POSITIVE, default=8192,
                   help="tokens the head may propose (the most frequent in the data)")
    add_quiet(p)
    p.set_defaults(func=cmd_train_speculator)
    return parser


def _omp_wait_policy() -> None:
    """OpenMP's wait policy for the CLI's process and the engine processes it spawns
    (envs.OMP_DEFAULTS), set before anything imports torch. A user's OMP_WAIT_POLICY or
    GOMP_SPINCOUNT wins."""
    os.environ.update(envs.omp_defaults(os.environ))


def main(argv: list[str] | None = None) -> None:
    _omp_wait_policy()
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    ns.argv = argv
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    progress.set_enabled(not ns.quiet)
    try:
        ns.func(ns)
    except (ConfigError, ValueError) as e:
        sys.exit(f"skyline: error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
